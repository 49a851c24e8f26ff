"""``python -m ropescale.training RUN_DIR ... --length L -o FIG [--before HARNESS_DIR ...]``: compare
fine-tuning runs (``ropescale.training.report.main``)."""

from ropescale.training.report import main

if __name__ == "__main__":
    main()
