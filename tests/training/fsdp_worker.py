"""Run by ``accelerate launch --multi_gpu --num_processes 2`` (gloo, CPU) from ``test_fsdp_cpu.py``:
a sharded fine-tuning run (``sharding: fsdp``: torch's ``fully_shard``) straight through into
``<out>/sharded``, and the same run stopped after step 2 and rerun into ``<out>/resumed`` — one
run per launch. The
main process writes ``<out>/worker.json``: the files the stopped run left in its checkpoint and
what the parameters look like inside the run (their type and local share)."""

import json
import os
import sys
from pathlib import Path

from ropescale.training import build_finetune_config, finetune


def main(cfg_path: str, out: str, phase: str) -> None:
    """One run per launch (``phase``: ``sharded``, ``stop``, ``resume``): a second process group set up
    in one launched process can hang in gloo's connect (torch reuses the destroyed group's name while
    torchrun's store still holds its peers' addresses), so each run gets a process of its own."""
    out = Path(out)
    cfg = build_finetune_config(json.loads(Path(cfg_path).read_text()))
    if phase == "sharded":
        finetune(cfg, out / "sharded", progress=False)
    elif phase == "stop":
        stopped = finetune(cfg, out / "resumed", progress=False, stop_after=2)
        checkpoint = out / "resumed" / "checkpoints" / "step-000002"
        files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
        if os.environ["RANK"] == "0":
            (out / "worker.json").write_text(json.dumps({"stopped": stopped, "checkpoint_files": files}))
    else:
        finetune(cfg, out / "resumed", progress=False)


if __name__ == "__main__":
    main(*sys.argv[1:4])
