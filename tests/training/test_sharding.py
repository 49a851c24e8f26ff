"""``sharding``: accelerate's FSDP (FULL_SHARD) plugin settings from ``fsdp`` or a plugin config
file, one-line errors for bad files, and on the CPU — where accelerate 1.15 does not shard: with
``Accelerator(cpu=True)`` two launched processes become a DDP (MULTI_CPU) group and the FSDP
plugin is dropped without a word (measured; see the module test below) — a plugin file refused,
``fsdp`` sharded by torch's ``fully_shard`` instead (``test_fsdp_cpu.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.config import ConfigError
from ropescale.training import build_finetune_config, finetune
from ropescale.training.config import fsdp_plugin_kwargs
from tests.launch import PROCESSES
from tests.training.test_config import cli, one_line_error, write  # noqa: F401 (write: fixture)

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port nothing listens on (launched tests on one machine must not share torchrun's 29500)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_shorthand_is_full_shard_per_decoder_layer():
    from accelerate.utils import FullyShardedDataParallelPlugin

    kwargs = fsdp_plugin_kwargs("fsdp")
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # FSDP2's FULL_SHARD
    assert kwargs["auto_wrap_policy"] == "transformer_based_wrap"  # units: the model's _no_split_modules
    assert str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT")


def test_fsdp_plugin_file_accepts_accelerate_config_sections(tmp_path):
    from accelerate.utils import FullyShardedDataParallelPlugin

    path = tmp_path / "fsdp.yaml"
    path.write_text("fsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: FULL_SHARD\n"
                    "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_offload_params: false\n")
    kwargs = fsdp_plugin_kwargs(str(path))
    assert kwargs["fsdp_version"] == 1 and kwargs["sharding_strategy"] == "FULL_SHARD"
    assert "reshard_after_forward" not in kwargs and kwargs["auto_wrap_policy"] == "transformer_based_wrap"
    assert kwargs["cpu_offload"] is False
    FullyShardedDataParallelPlugin(**kwargs)  # accelerate takes them
    path.write_text("fsdp_sharding_stratgy: FULL_SHARD\n")
    with pytest.raises(ConfigError, match=r"sharding: .*fsdp_sharding_stratgy: not an FSDP plugin argument "
                                          r"\(did you mean 'sharding_strategy'\?\)"):
        fsdp_plugin_kwargs(str(path))


PLUGIN_FILE = "fsdp_config:\n  fsdp_version: 2\n"


@pytest.mark.parametrize("overrides,fragments", [
    ({"sharding": "PLUGIN"}, ["sharding: an FSDP plugin file is accelerate's, which shards only on GPUs",
                              "use sharding: fsdp"]),
    ({"sharding": "fsdp"}, ["sharding: one process holds the whole model either way"]),
    ({"sharding": "nope.yaml", "device": "auto"}, ["sharding: 'nope.yaml' is neither 'fsdp' nor a readable"]),
    ({"sharding": "fsdp", "device": "cuda", "lora": True}, ["sharding: not combined with lora"]),
])
def test_bad_sharding_is_one_line(write, tmp_path, overrides, fragments):  # noqa: F811
    if overrides["sharding"] == "PLUGIN":
        (tmp_path / "plugin.yaml").write_text(PLUGIN_FILE)
        overrides = {**overrides, "sharding": str(tmp_path / "plugin.yaml")}
    one_line_error(cli(write(**overrides), "-q", "-o", tmp_path / "out"), *fragments)
    assert not (tmp_path / "out").exists()


def test_auto_device_without_cuda_refuses_a_plugin_file_before_training(tmp_path, tiny_run):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: accelerate shards")
    (tmp_path / "plugin.yaml").write_text(PLUGIN_FILE)
    with pytest.raises(ConfigError, match="sharding: an FSDP plugin file is accelerate's"):
        finetune(build_finetune_config(tiny_run(device="auto", sharding=str(tmp_path / "plugin.yaml"))),
                 tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@PROCESSES
def test_accelerate_drops_fsdp_on_cpu_processes(tmp_path):
    """Why the refusal: two processes launched as the training run launches them, with an FSDP
    plugin, get plain DDP — every process holds the whole model."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch\nfrom accelerate import Accelerator\n"
        "from accelerate.utils import FullyShardedDataParallelPlugin\n"
        "from ropescale.training.config import fsdp_plugin_kwargs\n"
        "acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs('fsdp')))\n"
        "model = acc.prepare(torch.nn.Linear(4, 4))\n"
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, f'rank{{acc.process_index}}.txt').write_text("
        "f'{acc.num_processes} {acc.distributed_type.value} {type(model).__name__}')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(script)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    for rank in (0, 1):  # each process writes its own file (their stdout lines interleave)
        assert (tmp_path / f"rank{rank}.txt").read_text() == "2 MULTI_CPU DistributedDataParallel"
