"""Two CPU processes (gloo) with half the per-process batch train exactly what one process
trains: the same global batches, the same loss curve (float tolerance), one writer.

``accelerate launch --cpu --num_processes 2`` starts a *single* process on a machine without
MPI (accelerate 1.15's simple launcher); ``--multi_gpu`` starts two through torchrun, and the
run makes them one gloo group (``Accelerator(cpu=True)`` when there is no GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

from ropescale.runs.manifest import folder_lock
from ropescale.training import build_finetune_config, finetune
from ropescale.training.report import read_log
from ropescale.training.sequence_parallel import deepspeed_available
from tests.launch import PROCESSES, launch_two

ROOT = Path(__file__).resolve().parents[2]


# the shipped-config run's after-training evaluations: both of the config's tasks at a few windows
AFTER = ("[{task: perplexity, lengths: [128, 512], max_windows: 2},"
         " {task: passkey, lengths: [128], passkey: {trials: 1, depths: [0.5]}}]")
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_run):
    """One launch of two processes running the four tests' fine-tunings in turn in one process group
    (``distributed_worker.py``): the two-process loss curve through ``cli.py finetune``; the refused runs
    and a fresh one through ``finetune``, while this process holds one folder's lock; LoRA with
    checkpointing through ``cli.py finetune``; the shipped config through ``cli.py finetune`` with its
    after-training evaluations. Returns the folder, the launch's result and the JSON lines by part."""
    tmp = tmp_path_factory.mktemp("launched")
    curve = tiny_run(strategy="yarn", steps=4, batch_size=4, checkpoint_every=2)
    (tmp / "ft.yaml").write_text(json.dumps({**curve, "batch_size": 2}))
    (tmp / "lora.yaml").write_text(json.dumps({**lora_run(tiny_run), "batch_size": 2}))
    refused = tiny_run(strategy="rerope", steps=1, batch_size=1, eval=None)
    finetune(build_finetune_config(refused), tmp / "finished", progress=False)
    if deepspeed_available():  # not part of the run's identity: the same experiment as the one-process run's
        refused["parallelism"] = {"sequence": 2}
    extra = ["--set", "parallelism.sequence=2"] if deepspeed_available() else []
    extra += ["--set", "report_to=[tensorboard]"] if TENSORBOARD else []
    plan = [{"part": "curve", "cli": ["finetune", str(tmp / "ft.yaml"), "-o", str(tmp / "two")]},
            {"part": "refusal", "raw": refused, "outs": [str(tmp / n) for n in ("busy", "finished", "fresh")]},
            {"part": "lora", "cli": ["finetune", str(tmp / "lora.yaml"), "-q", "-o", str(tmp / "lora-two")]},
            {"part": "shipped", "cli": ["finetune", str(ROOT / "configs" / "finetune-yarn.yaml"), "-q", "--steps", "2",
                                        "--set", "batch_size=1", "--set", "threads=1",
                                        "--set", "eval.data.max_documents=1", "--set", "eval.max_windows=1",
                                        "--set", f"eval.after={AFTER}", *extra, "-o", str(tmp / "shipped")]}]
    (tmp / "plan.json").write_text(json.dumps(plan))
    (tmp / "busy").mkdir()
    with folder_lock(tmp / "busy"):  # another run writing the folder
        res, lines = launch_two(Path(__file__).with_name("distributed_worker.py"), str(tmp / "plan.json"),
                                timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    by_part = {p["part"]: [x for x in lines if x["part"] == p["part"]] for p in plan}
    return tmp, res, by_part


@PROCESSES
def test_two_processes_give_one_process_loss_curve_and_only_the_main_process_writes(tmp_path, tiny_run, launched):
    tmp, res, by_part = launched
    raw = tiny_run(strategy="yarn", steps=4, batch_size=4, checkpoint_every=2)
    finetune(build_finetune_config(raw), tmp_path / "one", progress=False)
    assert by_part["curve"] == [{"part": "curve", "open": True}] * 2  # the group outlives the run
    assert res.stdout.count("fine-tuned yarn for 4 steps") == 1  # the main process reports
    one, two = read_log(tmp_path / "one"), read_log(tmp / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 2, 3, 4, 4]  # each line once
    summary = json.loads((tmp / "two" / "model" / "finetune.json").read_text())
    assert summary["processes"] == 2 and summary["tokens"] == 4 * 4 * 64  # the same global batch
    for a, b in zip(one, two):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
            assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
        else:
            for k in a["ppl"]:
                assert abs(a["ppl"][k] - b["ppl"][k]) <= 1e-5 * a["ppl"][k]
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name != ".ropescale.lock")
    assert files(tmp / "two") == files(tmp_path / "one")


def lora_run(tiny_run) -> dict:
    """LoRA (LoRA+ on embeddings and norms, saved as an adapter) with non-reentrant checkpointing, 3 steps."""
    return tiny_run(strategy="yarn", steps=3, batch_size=4, lr=1e-2, eval=None, checkpoint_every=10,
                    gradient_checkpointing=True, lora={"trainable_embeddings_norms": True, "save": "adapter"})


@PROCESSES
def test_two_processes_train_lora_with_checkpointing_as_one_does(tmp_path, tiny_run, launched):
    """DDP (two gloo processes) with frozen base weights, LoRA+ and non-reentrant checkpointing:
    the same loss curve as one process with the whole batch, the same adapter. (In the shared launch,
    after two other runs in the process group, as users run several.)"""
    from safetensors.torch import load_file

    from eval.finetune import run_finetune
    from tests.training.test_lora import losses

    tmp, _, by_part = launched
    assert by_part["lora"] == [{"part": "lora", "open": True}] * 2
    run_finetune(build_finetune_config(lora_run(tiny_run)), tmp_path / "one", progress=False)
    assert json.loads((tmp / "lora-two" / "model" / "finetune.json").read_text())["processes"] == 2
    assert losses(tmp / "lora-two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a, b = (load_file(d / "model" / "adapter_model.safetensors") for d in (tmp_path / "one", tmp / "lora-two"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-4 * a[k].abs().max(), k


@PROCESSES
def test_a_refusal_reaches_every_process_and_later_runs_in_the_process_share_its_group(launched):
    """Only the main process holds the folder's lock and writes the manifest: its refusal (another run
    holds the folder; the folder holds the finished one-process run) reached the other process as gloo's
    "Connection closed by peer", and every later run in the launched process set a second gloo group up,
    which hangs ("the second gloo group"). Now each process raises the same one line, the next run works
    on the same group, and the group is closed at exit (left open, gloo can abort: "terminate called
    without an active exception")."""
    tmp, res, by_part = launched
    by_run = {n: [x for x in by_part["refusal"] if x["run"] == n] for n in ("busy", "finished", "fresh")}
    busy = (f"{tmp / 'busy'} is being written by another run (lock .ropescale.lock); wait for it to finish "
            "or use another output folder")
    assert by_run["busy"] == [{"part": "refusal", "run": "busy", "error": "FolderBusyError", "message": busy,
                               "open": True}] * 2
    finished = by_run["finished"]
    assert [x["error"] for x in finished] == ["ExperimentMismatchError"] * 2, finished
    assert finished[0]["message"] == finished[1]["message"] and "processes: 2 now, 1 in the folder" in \
        finished[0]["message"]
    assert by_run["fresh"] == [{"part": "refusal", "run": "fresh", "steps": 1, "processes": 2, "open": True}] * 2
    assert "Connection closed" not in res.stderr and "terminate called" not in res.stderr
    assert not (tmp / "busy" / "manifest.json").exists()  # refused before anything was written


@PROCESSES
def test_a_shipped_config_finishes_under_accelerate_launch_with_its_after_training_evaluations(launched):
    """`accelerate launch --multi_gpu --num_processes 2 cli.py finetune configs/finetune-yarn.yaml --strategy
    rerope --set parallelism.sequence=2` trained and saved, then hung in its after-training evaluations
    (each closed the process group; the next set a second one up) — whatever the strategy. Small: 2 steps,
    one held-out book, both of the config's evaluation tasks at a few windows, one thread per process;
    sequence-parallel where DeepSpeed is installed. Run after three other runs in the same launched process."""
    tmp, res, by_part = launched
    assert by_part["shipped"] == [{"part": "shipped", "open": True}] * 2
    assert res.stdout.count("fine-tuned yarn:factor=4 for 2 steps") == 1, res.stdout  # the main process reports
    out = tmp / "shipped"
    for task, cells in (("perplexity", 2), ("passkey", 1)):  # each evaluated by both processes, written once
        assert len((out / "eval" / task / "results.jsonl").read_text().splitlines()) == cells, task
        assert json.loads((out / "eval" / task / "manifest.json").read_text())["processes"] == 2
    if TENSORBOARD:  # written by the main process alone: one writer's files, each step once
        from tests.training.test_trackers import _scalars

        writers = {p.name.split(".")[-2] for p in out.rglob("events.out.tfevents.*")}  # …tfevents.<t>.<host>.<pid>.<n>
        assert len(writers) == 1, writers
        assert [step for step, _ in _scalars(out)["loss"]] == [1, 2]
