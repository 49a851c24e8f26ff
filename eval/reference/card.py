"""Measure the bundled reference model and write its model card (``README.md``).

    ropescale reference card --model ropescale/reference/kjv-llama [--plot curves.png]

Runs the harness on held-out books (perplexity at T and 8T, passkey at T over six depths) and
the copy probe, stores the figures under ``card`` in ``training.json`` and writes the card.
About 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ropescale.errors import InvalidInput
from ropescale.reference import kjv
from ropescale.runs.plotting import pyplot, save_figure

from ..writable import check_figure, check_folder
from .train import check_cores, copy_probe, token_stream

PASSKEY_TRIALS = 20


def measure(model_dir: Path) -> dict:
    """The reference model's card figures on the held-out books: perplexity at T and 8T, passkey at T."""
    from ropescale.models import load_model

    from ..config import build_config
    from ..sweep import run_sweep

    model, tok = load_model(str(model_dir), device="cpu")
    held = token_stream(tok, [t for _, t in kjv.split("heldout")])
    probe = copy_probe(model, held, n=40, passages=64)
    with tempfile.TemporaryDirectory() as tmp:
        ppl = run_sweep(build_config({"model": str(model_dir), "data": "kjv-heldout", "lengths": [128, 1024],
                                      "strategies": ["vanilla"], "device": "cpu"}), Path(tmp) / "ppl", progress=False)
        (pk,) = run_sweep(build_config({"task": "passkey", "model": str(model_dir), "lengths": [128],
                                        "strategies": ["vanilla"], "device": "cpu",
                                        "passkey": {"trials": PASSKEY_TRIALS}}), Path(tmp) / "pk", progress=False)
    at_t, at_8t = ppl[0]["ppl"], ppl[1]["ppl"]
    return {"heldout_ppl_at_T": round(at_t, 2), "heldout_ppl_at_8T": round(at_8t, 2),
            "ppl_ratio_8T_over_T": round(at_8t / at_t, 3), "copy_probe": probe,
            "passkey_at_T": {"accuracy": pk["accuracy"], "accuracy_ci": [round(x, 3) for x in pk["accuracy_ci"]],
                             "candidate_accuracy": pk["candidate_accuracy"], "trials": pk["trials"],
                             "by_depth": {d["depth"]: d["accuracy"] for d in pk["by_depth"]}}}


def model_card(s: dict, c: dict, train_books: list, held_books: list) -> str:
    """The bundled reference model's card (README.md) from its training summary and checks.

    Args:
        s: the training summary (both stages).
        c: the checks (passkey at T, the copy probe, ...).
        train_books: the training books, ``[(name, text)]``.
        held_books: the held-out books.

    Returns:
        The card's Markdown.
    """
    held = ", ".join(name for name, _ in held_books)
    s1 = s.get("stage1") or s
    pk, cp = c["passkey_at_T"], c["copy_probe"]

    def shares(mix: dict) -> str:
        return ", ".join(f"{k} {v:.0%}" for k, v in mix.items())

    stage2 = "" if s1 is s else f"""
- **Stage 2** (`--init`): {s['steps']} steps from stage 1's weights, AdamW lr {s['lr']}, {s['warmup']}
  warm-up steps, cosine to 10 %; mix {shares(s['mix'])}; the answer of passkey/needle documents
  followed by `{s['answer_end']}` (stage 1 ended the window at the answer, so the model kept adding
  digits after the key); {s['train_seconds']:.0f} s."""
    phase = (f"the copy mix ({shares(s1['copy_mix'])}) until step {s1['copy_phase_end']}, then "
             if s1.get("copy_mix") else "")
    return f"""# kjv-llama — ropescale's reference model

A tiny `LlamaForCausalLM` trained from scratch on the King James Bible so that RoPE
length-extrapolation experiments — perplexity *and* retrieval — run offline. Not a useful
language model for anything else.

- **Text**: Debian `bible-kjv` (public domain), verse numbers and chapter headings removed,
  one document per book. Held out (never seen by tokenizer or model): {held}
  ({len(held_books)} books, {s['heldout_tokens']:,} tokens). Training: the other
  {len(train_books)} books ({s['train_tokens']:,} tokens).
- **Tokenizer**: byte-level BPE, vocab 4096, `<|endoftext|>` as BOS/EOS.
- **Model**: hidden 256, 4 layers, 8 heads, head_dim 32, MLP 688, untied embeddings,
  {s['parameters']:,} parameters, `max_position_embeddings` = training window T = {s['window']},
  `rope_theta` 10000, vanilla RoPE.
- **Training data**: every batch mixes windows of T tokens of five kinds. `kjv` = plain
  training-book windows; `passkey` / `needle` = the passkey and needle tasks' templates
  (`eval/tasks`) over *training-book* verses as filler, a 3–7-digit key at a random depth, the
  answer included; `repeat` = a training-book passage of 8–60 tokens repeated to fill the window;
  `random` = 5–30 random tokens repeated. The copy-rewarding kinds make induction heads form;
  `training.json` logs a copy probe on held-out books during training (the phase change).
- **Stage 1**: from scratch, seed {s1['seed']}, {s1['steps']} steps of {s1['batch_size']} windows, AdamW lr
  {s1['lr']} (betas 0.9/0.95, weight decay 0.1), {s1['warmup']} warm-up steps, cosine to 10 %, grad-norm
  clip 1.0; {phase}the main mix ({shares(s1['mix'])}); {s1['train_seconds']:.0f} s.{stage2}
- Both stages on {s['threads']} CPU threads (torch {s['torch']}); together
  {s1['train_seconds'] + (0 if s1 is s else s['train_seconds']):.0f} s.

## Measured on the held-out books (`ropescale reference card`)

| what | value |
|---|---|
| perplexity at T (chunk windows of 128 tokens) | {c['heldout_ppl_at_T']} |
| perplexity at 8T, vanilla RoPE (the extrapolation problem) | {c['heldout_ppl_at_8T']} ({
    c['ppl_ratio_8T_over_T']}× T) |
| passkey at T, vanilla, greedy exact match ({pk['trials']} keys over depths 0…1) | {pk['accuracy']:.3f} (95% CI {
    pk['accuracy_ci'][0]:.3f}–{pk['accuracy_ci'][1]:.3f}) |
| passkey at T, candidate log-likelihood (1 of 10) | {pk['candidate_accuracy']:.3f} |
| 40-token passage repeated: loss on first / second copy (nats) | {cp['first_copy_loss']} / {cp['second_copy_loss']} |
| top-1 accuracy on the second copy | {cp['second_copy_top1']} |

Reproduce (bit-exact reproduction also needs the same torch build and thread count):

```bash
ropescale reference train --output stage1 --seed {s1['seed']} --steps {s1['steps']} --answer-end ''
ropescale reference train --init stage1 --output DIR --steps {s['steps']} --lr {s['lr']} --warmup {s['warmup']} \\
    --mix {",".join(f"{k}={v:g}" for k, v in s['mix'].items())} --probe-every {s['probe_every']}
ropescale reference card --model DIR
```
"""


def plot_training(summary: dict, path: Path) -> None:
    """Training loss and the copy probe (first vs second copy) against step, both stages."""
    plt = pyplot()
    s1 = summary.get("stage1") or summary
    offset = s1["steps"] if s1 is not summary else 0
    stages = [(s1, 0)] + ([(summary, offset)] if s1 is not summary else [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for k, (st, off) in enumerate(stages):
        a.plot([x["step"] + off for x in st["log"]], [x["loss"] for x in st["log"]], color="tab:blue", lw=1,
               label="training loss (batch)" if k == 0 else None)
        steps = [p["step"] + off for p in st["probes"]]
        b.plot(steps, [p["first_copy_loss"] for p in st["probes"]], color="tab:red", marker="o", ms=3,
               label="first copy" if k == 0 else None)
        b.plot(steps, [p["second_copy_loss"] for p in st["probes"]], color="tab:green", marker="o", ms=3,
               label="second copy" if k == 0 else None)
    for ax in (a, b):
        if s1 is not summary:
            ax.axvline(offset, color="grey", ls="--", lw=0.8)
            ax.annotate("stage 2", (offset, 1), xycoords=("data", "axes fraction"), xytext=(4, -12),
                        textcoords="offset points", fontsize=8, color="grey")
        if s1.get("copy_phase_end"):
            ax.axvspan(0, s1["copy_phase_end"], color="tab:orange", alpha=0.1, lw=0)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    a.set_ylabel("loss (nats)")
    b.set_ylabel("loss on a held-out passage repeated once (nats)")
    b.set_title("copy probe: induction heads form", fontsize=10)
    a.set_title("training loss (shaded: copy-heavy mix)", fontsize=10)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    save_figure(fig, path)


# what the card and the curves read of training.json (a stage-2 model's stage 1 under "stage1")
SUMMARY_KEYS = ("seed", "steps", "batch_size", "window", "lr", "warmup", "mix", "answer_end", "parameters",
                "train_tokens", "heldout_tokens", "train_seconds", "threads", "torch", "probe_every", "log", "probes")
STAGE1_KEYS = ("seed", "steps", "batch_size", "lr", "warmup", "mix", "train_seconds", "log", "probes")


def read_summary(model: Path) -> dict:
    """``training.json`` of the model folder ``model``, checked for what the card reads. Raises
    ``InvalidInput`` in one line (no such file, not JSON, not a mapping, keys missing)."""
    path = model / "training.json"
    hint = "(a model folder `ropescale reference train` wrote)"
    if not path.is_file():
        raise InvalidInput(f"--model {model}: no training.json {hint}")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"--model {model}: {path} is not JSON ({e}) {hint}") from None
    stage1 = summary.get("stage1") if isinstance(summary, dict) else None
    for part, keys, where in ((summary, SUMMARY_KEYS, ""), (stage1, STAGE1_KEYS, "stage1.")):
        if part is None and where:
            continue
        if not isinstance(part, dict):
            raise InvalidInput(f"--model {model}: {path}: {where or 'the file '}is not a mapping of the training "
                               f"record but a {type(part).__name__} {hint}")
        missing = [k for k in keys if k not in part]
        if missing:
            raise InvalidInput(f"--model {model}: {path} lacks {', '.join(where + k for k in missing)} {hint}")
    return summary


def write_card(model: Path, *, threads: int = 2, plot: Path | None = None) -> dict:
    """Measure the model in folder ``model`` (``measure``), store the figures under ``card`` in its
    ``training.json``, write its card (``README.md``), draw the training curves into ``plot`` if
    given, and return the figures (``ropescale reference card``). Raises ``InvalidInput`` (one
    line) before measuring for a ``training.json`` that is missing or not the training record,
    more threads than CPU cores, a model folder that cannot be written, or a ``plot`` file
    matplotlib cannot save there."""
    model = Path(model)
    summary = read_summary(model)
    check_cores(threads)
    check_folder(model, f"--model {model}")  # training.json and README.md are written there
    if plot:
        check_figure(plot, f"--plot {plot}")
    torch.set_num_threads(threads)
    summary["card"] = measure(model)
    (model / "training.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (model / "README.md").write_text(model_card(summary, summary["card"], kjv.split("train"), kjv.split("heldout")),
                                     encoding="utf-8")
    if plot:
        plot_training(summary, Path(plot))
    return summary["card"]
