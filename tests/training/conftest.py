import pytest


@pytest.fixture(scope="session")
def heldout_file(tmp_path_factory):
    """Held-out text for the tiny runs (the training text is ``text_file``, Ruth)."""
    from ropescale.reference import kjv

    path = tmp_path_factory.mktemp("heldout") / "habakkuk.txt"
    path.write_text(dict(kjv.split("heldout"))["Habakkuk"])
    return path


@pytest.fixture(scope="session")
def tiny_run(tiny_model_dir, text_file, heldout_file):
    """A raw fine-tuning config on the tiny model (T = 32): a few steps at L = 64."""

    def make(**overrides):
        raw = {"model": str(tiny_model_dir), "strategy": "linear", "data": str(text_file), "length": 64,
               "steps": 4, "batch_size": 2, "lr": 3e-3, "warmup": 1, "device": "cpu", "checkpoint_every": 2,
               "eval": {"every": 2, "data": str(heldout_file), "max_windows": 4}}
        return raw | overrides

    return make
