"""Every YAML experiment in configs/ validates under the command its first line names
(``# ropescale eval|sweep|finetune|search configs/NAME.yaml``), with its strategies resolved."""

from pathlib import Path

import pytest

from eval.config import build_config, read_yaml
from eval.search.config import load_search_config
from ropescale.training import load_finetune_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs_of_every_command():
    commands = {p.read_text().splitlines()[0].split()[2] for p in CONFIGS}
    assert commands == {"eval", "sweep", "finetune", "search"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_under_its_command(path):
    header = path.read_text().splitlines()[0].split()
    assert header[:2] == ["#", "ropescale"] and header[3] == f"configs/{path.name}"
    if header[2] == "finetune":
        cfg = load_finetune_config(path)
        assert cfg.output == f"runs/{path.stem}"
    elif header[2] == "search":
        cfg = load_search_config(str(path))
        assert cfg.output == f"runs/{path.stem}"
    else:
        raw = read_yaml(path)
        cfg = build_config(raw, str(path))
        assert header[2] == "eval" or raw.get("task", "perplexity") == "perplexity"
        assert cfg.output
