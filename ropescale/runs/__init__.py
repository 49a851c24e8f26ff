"""What every run shares — evaluation experiments and fine-tuning alike.

- ``config``: config primitives (``ConfigError``, ``RunConfig``, strategy entries, the data source, YAML, ``--set``),
  the one config loader (``load_raw``) and error formatter (``explain``) of every config kind
- ``data``: documents from the bundled KJV text, local files or Hugging Face ``datasets``
- ``windows``: windows of L tokens over tokenized documents
- ``scoring``: next-token NLL of windows in O(n·d) memory (the chunked output head)
- ``manifest``: one run folder = one experiment (manifest, lock, fingerprints, output checks)
- ``protocol``: the one run protocol (``RunKind``, ``execute_run``: folder → lock → tokenizer and data
  once → identity → manifest → model → T → execution) of sweeps, fine-tuning and searches
- ``lifecycle``: its steps (``claimed_folder``, ``load_inputs``, ``run_identity``, ``load_run_model``, T)
- ``plotting``: matplotlib helpers shared by every figure
"""
