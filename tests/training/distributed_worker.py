"""Run in two launched processes by ``test_distributed.py``: the fine-tuning runs of its three tests in one
process group, in turn, as users run several runs in one launched process (a launch costs two interpreters
and a group). Prints one JSON object per run and process.

argv: ``PLAN.json``, a list of parts. ``{"cli": [...], "part": name}`` runs ``cli.py`` in the process;
``{"raw": {...}, "outs": [...], "part": name}`` runs ``finetune`` for each folder, reporting what each
process raised."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from cli import main
from ropescale.training import build_finetune_config, finetune

for part in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
    if "cli" in part:
        main(part["cli"], standalone_mode=False)
        print(json.dumps({"part": part["part"], "open": dist.is_initialized()}), flush=True)
        continue
    for out in part["outs"]:
        try:
            summary = finetune(build_finetune_config(part["raw"]), out, progress=False)
            got = {"steps": summary["steps"], "processes": summary["processes"]}
        except Exception as e:  # noqa: BLE001 (what each process raised)
            got = {"error": type(e).__name__, "message": str(e)}
        print(json.dumps({"part": part["part"], "run": out.rsplit("/", 1)[-1], **got, "open": dist.is_initialized()}),
              flush=True)
