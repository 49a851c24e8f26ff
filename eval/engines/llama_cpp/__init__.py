"""llama.cpp on the harness side: its environment and converter source (here), its parity driver
(``parity.py``), and the scripts run in llama-cpp-python's own Python (``scripts/llama_cpp_driver.py``;
``scripts/convert_gguf.py``, llama.cpp's own converter). The export itself is the library's
(``ropescale.serving.engines.llama_cpp``, ``ropescale.serving.gguf``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..process import Environment, engine_roots

__all__ = ["ENVIRONMENT", "llama_cpp_source"]

# llama-cpp-python compiles llama.cpp: bench/engines/install.sh llama.cpp
ENVIRONMENT = Environment(engine="llama.cpp", variable="ROPESCALE_LLAMA_CPP_PYTHON", venv="llama",
                          scripts=Path(__file__).resolve().parent / "scripts", script="llama_cpp_driver.py")


def llama_cpp_source() -> Path | None:
    """llama.cpp's source folder (holding ``convert_hf_to_gguf.py`` and ``gguf-py``) from the llama-cpp-python
    sdist: ``ROPESCALE_LLAMA_CPP_SOURCE``, else ``<root>/llama/src/llama.cpp``; None when there is none."""
    given = os.environ.get("ROPESCALE_LLAMA_CPP_SOURCE")
    candidates = [Path(given)] if given else [r / "llama" / "src" / "llama.cpp" for r in engine_roots()]
    return next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)
