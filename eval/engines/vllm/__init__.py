"""vLLM on the harness side: its environment (here), its parity driver (``parity.py``), its scoring engine and
config options (``scoring.py``), and the script run in vLLM's own Python (``scripts/vllm_driver.py``). The
export itself is the library's (``ropescale.serving.engines.vllm``)."""

from __future__ import annotations

from pathlib import Path

from ..process import Environment

__all__ = ["ENVIRONMENT"]

# vLLM pins its own torch and transformers: bench/engines/install.sh vllm
ENVIRONMENT = Environment(engine="vllm", variable="ROPESCALE_VLLM_PYTHON", venv="vllm",
                          scripts=Path(__file__).resolve().parent / "scripts", script="vllm_driver.py")
