"""What every run shares — evaluation experiments and fine-tuning alike.

- ``config``: config primitives (``ConfigError``, strategy entries, the data source, YAML, ``--set``)
- ``data``: documents from the bundled KJV text, local files or Hugging Face ``datasets``
- ``windows``: windows of L tokens over tokenized documents
- ``scoring``: next-token NLL of windows in O(n·d) memory (the chunked output head)
- ``manifest``: one run folder = one experiment (manifest, lock, fingerprints, output checks)
- ``plotting``: matplotlib helpers shared by every figure
"""
