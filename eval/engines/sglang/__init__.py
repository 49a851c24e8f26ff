"""SGLang on the harness side: its parity driver (``parity.py``), through the library's re-implementation
(``ropescale.serving.engines.sglang``) — SGLang does not run on this project's CPU machine, so it has no
environment and no scoring engine."""
