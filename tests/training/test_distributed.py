"""Two CPU processes (gloo) with half the per-process batch train exactly what one process
trains: the same global batches, the same loss curve (float tolerance), one writer.

``accelerate launch --cpu --num_processes 2`` starts a *single* process on a machine without
MPI (accelerate 1.15's simple launcher); ``--multi_gpu`` starts two through torchrun, and the
run makes them one gloo group (``Accelerator(cpu=True)`` when there is no GPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from ropescale.runs.manifest import folder_lock
from ropescale.training import build_finetune_config, finetune
from ropescale.training.report import read_log
from ropescale.training.sequence_parallel import deepspeed_available
from tests.launch import PROCESSES, launch_two

ROOT = Path(__file__).resolve().parents[2]


@PROCESSES
def test_two_processes_give_one_process_loss_curve_and_only_the_main_process_writes(tmp_path, tiny_run):
    raw = tiny_run(strategy="yarn", steps=4, batch_size=4, checkpoint_every=2)
    finetune(build_finetune_config(raw), tmp_path / "one", progress=False)
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(json.dumps({**raw, "batch_size": 2}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          str(ROOT / "cli.py"), "finetune", str(cfg), "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("fine-tuned yarn for 4 steps") == 1  # the main process reports
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 2, 3, 4, 4]  # each line once
    summary = json.loads((tmp_path / "two" / "model" / "finetune.json").read_text())
    assert summary["processes"] == 2 and summary["tokens"] == 4 * 4 * 64  # the same global batch
    for a, b in zip(one, two):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
            assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
        else:
            for k in a["ppl"]:
                assert abs(a["ppl"][k] - b["ppl"][k]) <= 1e-5 * a["ppl"][k]
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name != ".ropescale.lock")
    assert files(tmp_path / "two") == files(tmp_path / "one")


RUNS = """
import json, sys
import torch.distributed as dist
from ropescale.training import build_finetune_config, finetune

raw = json.loads(sys.argv[1])
for out in sys.argv[2:]:
    try:
        summary = finetune(build_finetune_config(raw), out, progress=False)
        got = {"steps": summary["steps"], "processes": summary["processes"]}
    except Exception as e:  # what each process raised
        got = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps({"run": out.rsplit("/", 1)[-1], **got, "open": dist.is_initialized()}), flush=True)
"""


@PROCESSES
def test_a_refusal_reaches_every_process_and_later_runs_in_the_process_share_its_group(tmp_path, tiny_run):
    """Only the main process holds the folder's lock and writes the manifest: its refusal (another run
    holds the folder; the folder holds the finished one-process run) reached the other process as gloo's
    "Connection closed by peer", and every later run in the launched process set a second gloo group up,
    which hangs ("the second gloo group"). Now each process raises the same one line, the next run works
    on the same group, and the group is closed at exit (left open, gloo can abort: "terminate called
    without an active exception")."""
    raw = tiny_run(strategy="rerope", steps=1, batch_size=1, eval=None)
    finetune(build_finetune_config(raw), tmp_path / "finished", progress=False)
    if deepspeed_available():  # not part of the run's identity: the same experiment as the one-process run's
        raw["parallelism"] = {"sequence": 2}
    (tmp_path / "busy").mkdir()
    (tmp_path / "run.py").write_text(RUNS)
    with folder_lock(tmp_path / "busy"):  # another run writing the folder
        res, lines = launch_two(tmp_path / "run.py", json.dumps(raw),
                                *(str(tmp_path / n) for n in ("busy", "finished", "fresh")), timeout=420)
    assert res.returncode == 0, res.stderr[-3000:]
    by_run = {n: [x for x in lines if x["run"] == n] for n in ("busy", "finished", "fresh")}
    busy = (f"{tmp_path / 'busy'} is being written by another run (lock .ropescale.lock); wait for it to finish "
            "or use another output folder")
    assert by_run["busy"] == [{"run": "busy", "error": "FolderBusyError", "message": busy, "open": True}] * 2
    finished = by_run["finished"]
    assert [x["error"] for x in finished] == ["ExperimentMismatchError"] * 2, finished
    assert finished[0]["message"] == finished[1]["message"] and "processes: 2 now, 1 in the folder" in \
        finished[0]["message"]
    assert by_run["fresh"] == [{"run": "fresh", "steps": 1, "processes": 2, "open": True}] * 2
    assert "Connection closed" not in res.stderr and "terminate called" not in res.stderr
    assert not (tmp_path / "busy" / "manifest.json").exists()  # refused before anything was written


@PROCESSES
def test_a_shipped_config_finishes_under_accelerate_launch_with_its_after_training_evaluations(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 cli.py finetune configs/finetune-yarn.yaml --strategy
    rerope --set parallelism.sequence=2` trained and saved, then hung in its after-training evaluations
    (each closed the process group; the next set a second one up) — whatever the strategy. Small: 2 steps,
    one held-out book, both of the config's evaluation tasks at a few windows, one thread per process;
    sequence-parallel where DeepSpeed is installed."""
    after = ("[{task: perplexity, lengths: [128, 512], max_windows: 2},"
             " {task: passkey, lengths: [128], passkey: {trials: 1, depths: [0.5]}}]")
    extra = ["--set", "parallelism.sequence=2"] if deepspeed_available() else []
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    extra += ["--set", "report_to=[tensorboard]"] if tensorboard else []
    out = tmp_path / "run"
    res, _ = launch_two(ROOT / "cli.py", "finetune", str(ROOT / "configs" / "finetune-yarn.yaml"), "-q",
                        "--steps", "2", "--set", "batch_size=1", "--set", "threads=1",
                        "--set", "eval.data.max_documents=1", "--set", "eval.max_windows=1",
                        "--set", f"eval.after={after}", *extra, "-o", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("fine-tuned yarn:factor=4 for 2 steps") == 1, res.stdout  # the main process reports
    for task, cells in (("perplexity", 2), ("passkey", 1)):  # each evaluated by both processes, written once
        assert len((out / "eval" / task / "results.jsonl").read_text().splitlines()) == cells, task
        assert json.loads((out / "eval" / task / "manifest.json").read_text())["processes"] == 2
    if tensorboard:  # written by the main process alone: one writer's files, each step once
        from tests.training.test_trackers import _scalars

        writers = {p.name.split(".")[-2] for p in out.rglob("events.out.tfevents.*")}  # …tfevents.<t>.<host>.<pid>.<n>
        assert len(writers) == 1, writers
        assert [step for step, _ in _scalars(out)["loss"]] == [1, 2]
