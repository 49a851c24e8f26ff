"""MLX (mlx-lm) on the harness side: its environment (here), its parity driver (``parity.py``), its scoring engine
(``scoring.py``: log-probabilities only), and the script run in mlx-lm's own Python (``scripts/mlx_driver.py``).
The export itself is the library's (``ropescale.serving.engines.mlx``)."""

from __future__ import annotations

from pathlib import Path

from ..process import Environment

__all__ = ["ENVIRONMENT"]

# pip install "mlx[cpu]" mlx-lm, which runs on a Linux CPU: bench/engines/install.sh mlx
ENVIRONMENT = Environment(engine="mlx", variable="ROPESCALE_MLX_PYTHON", venv="mlx",
                          scripts=Path(__file__).resolve().parent / "scripts", script="mlx_driver.py")
