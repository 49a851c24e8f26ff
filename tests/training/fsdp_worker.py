"""Run by ``accelerate launch --multi_gpu --num_processes 2`` (gloo, CPU) from ``test_fsdp_cpu.py``:
a sharded fine-tuning run (``sharding: fsdp``: torch's ``fully_shard``) straight through into
``<out>/sharded``, then the same run stopped after step 2 and rerun into ``<out>/resumed`` — three
runs in one launched process, on the process group the first one sets up. The main process writes
``<out>/worker.json``: the files the stopped run left in its checkpoint."""

import json
import os
import sys
from pathlib import Path

from ropescale.training import build_finetune_config, finetune


def main(cfg_path: str, out: str) -> None:
    out = Path(out)
    cfg = build_finetune_config(json.loads(Path(cfg_path).read_text()))
    finetune(cfg, out / "sharded", progress=False)
    stopped = finetune(cfg, out / "resumed", progress=False, stop_after=2)
    checkpoint = out / "resumed" / "checkpoints" / "step-000002"
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    if os.environ["RANK"] == "0":
        (out / "worker.json").write_text(json.dumps({"stopped": stopped, "checkpoint_files": files}))
    finetune(cfg, out / "resumed", progress=False)


if __name__ == "__main__":
    main(*sys.argv[1:3])
