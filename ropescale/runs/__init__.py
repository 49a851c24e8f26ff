"""What every run shares — evaluation experiments and fine-tuning alike.

- ``config``: config primitives (``ConfigError``, strategy entries, the data source, YAML, ``--set``),
  the one config loader (``load_raw``) and error formatter (``explain``) of every config kind
- ``data``: documents from the bundled KJV text, local files or Hugging Face ``datasets``
- ``windows``: windows of L tokens over tokenized documents
- ``scoring``: next-token NLL of windows in O(n·d) memory (the chunked output head)
- ``manifest``: one run folder = one experiment (manifest, lock, fingerprints, output checks)
- ``lifecycle``: the one run lifecycle (folder → lock → tokenizer and data once → identity → manifest →
  model → T) of sweeps, fine-tuning and searches
- ``plotting``: matplotlib helpers shared by every figure
"""
