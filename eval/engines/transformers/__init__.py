"""transformers on the harness side, in this process: its parity driver (``parity.py``: the export loaded back
by plain ``from_pretrained``) and its scoring engine (``scoring.py``: the patched model measuring every task
itself, the default)."""
