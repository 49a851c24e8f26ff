"""The tables of docs/results-real-models.md, from the run folders bench/real_models.sh fills.

    python bench/real_models_report.py [--runs runs] > tables.md

Each table is printed under a line naming the run folder, model, data, dtype and settings that produced it, with
its uncertainty beside every number: a perplexity's 95% block-bootstrap interval, an accuracy's 95% Wilson
interval with its trials. A folder not (yet) there is named and skipped; a cell not yet measured is blank.
Perplexity tables also give, per cell, the difference to vanilla's NLL on the same tokens with a 95% paired
block-bootstrap interval (the blocks the records keep), which ranks strategies more sharply than overlapping
intervals of each alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.sweep import read_results
from ropescale.runs.uncertainty import wilson

FOLDERS = {
    "smollm2-perplexity": "perplexity", "smollm2-perplexity-handbook": "perplexity",
    "smollm2-short-context": "kl", "smollm2-passkey": "retrieval", "smollm2-ruler": "ruler",
    "smollm2-longppl": "longppl", "smollm2-finetune-yarn": "finetune", "smollm2-finetune-linear": "finetune",
    "smollm2-finetune-yarn-handbook": "perplexity",
    "search-smollm2-yarn": "search", "gemma3-270m-perplexity-4t": "perplexity",
    "gemma3-270m-passkey-multi": "retrieval", "smollm2-json-kv": "generation", "smollm2-graphwalks": "generation",
}


def _caption(folder: Path, records: list[dict]) -> str:
    r = records[0]
    env = r.get("env", {})
    opts = {k: v for k, v in (r.get("options") or {}).items() if v is not None and k not in ("depths",)}
    return (f"`{folder.name}`: model `{r['model']}` (T = {r['train_length']}), data `{r.get('data') or '—'}`, "
            f"{r.get('dtype')}, task `{r.get('task')}` {json.dumps(opts)}; torch {env.get('torch', '?')}, "
            f"transformers {env.get('transformers', '?')}")


def _grid(records: list[dict], cell) -> list[str]:
    lengths = sorted({r["length"] for r in records})
    train = records[0]["train_length"]
    names = list(dict.fromkeys(r["strategy"] for r in records))
    by = {(r["strategy"], r["length"]): r for r in records}
    head = ["strategy"] + [f"{n:,}" + (" (T)" if n == train else f" ({n / train:g}T)") for n in lengths]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(lengths)]
    for s in names:
        out.append("| " + " | ".join([s] + [cell(by[s, n]) if (s, n) in by else "" for n in lengths]) + " |")
    return out


def paired_delta(rec: dict, base: dict, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float] | None:
    """Mean NLL difference ``rec − base`` [nats/token] on the same blocks, with a 95% paired bootstrap interval."""
    a, b = rec.get("nll_blocks"), base.get("nll_blocks")
    if not a or not b or rec.get("block_tokens") != base.get("block_tokens"):
        return None
    d, n = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64), \
        torch.tensor(rec["block_tokens"], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(d), (resamples, len(d)), generator=gen)
    boot = d[idx].sum(1) / n[idx].sum(1)
    low, high = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(d.sum() / n.sum()), low, high


def perplexity(records: list[dict]) -> list[str]:
    base = {r["length"]: r for r in records if r["strategy"] == "vanilla"}

    def cell(r: dict) -> str:
        ci = r.get("ppl_ci")
        text = f"{r['ppl']:.2f}" + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")
        if r.get("same_as"):
            return text + f" = {r['same_as']}"
        delta = paired_delta(r, base[r["length"]]) if r["length"] in base and r["strategy"] != "vanilla" else None
        if delta:
            text += f" [Δ {delta[0]:+.3f} ({delta[1]:+.3f}…{delta[2]:+.3f})]"
        return text

    windows = {r["length"]: (r["windows"], r["tokens"]) for r in records}
    note = ", ".join(f"{n:,}: {w} window{'s' * (w > 1)}, {t:,} tokens" for n, (w, t) in sorted(windows.items()))
    legend = (f"Scored per cell — {note}. PPL (95% block-bootstrap interval) [Δ mean NLL to vanilla on the same "
              "tokens, nats/token (95% paired interval)]; `= x`: rotates bit for bit as x, not run again.")
    return _grid(records, cell) + ["", legend] + ranking(records) + past_window(records)


def _mean_nll(buckets: list[dict]) -> float:
    return sum(b["nll"] * b["tokens"] for b in buckets) / sum(b["tokens"] for b in buckets)


def _from_block(rec: dict, cut: int) -> dict:
    return {**rec, "nll_blocks": rec["nll_blocks"][cut:], "block_tokens": rec["block_tokens"][cut:]}


def ranking(records: list[dict]) -> list[str]:
    """At each length with three or more cells of one window each, the cells ranked by mean NLL, each with its
    paired difference to the best one (95% block bootstrap over the same tokens): which differences are real."""
    out = []
    for length in sorted({r["length"] for r in records}):
        rows = sorted((r for r in records if r["length"] == length and r.get("nll_blocks") and not r.get("same_as")),
                      key=lambda r: r["nll"])
        if len(rows) < 3:
            continue
        best = rows[0]
        cells = [f"{best['strategy']} (best)"]
        for r in rows[1:]:
            d = paired_delta(r, best)
            cells.append(f"{r['strategy']} {d[0]:+.3f} ({d[1]:+.3f}…{d[2]:+.3f})" if d else r["strategy"])
        out.append(f"- {length:,}: " + "; ".join(cells))
    return ["", "Ranked by mean NLL, each against the best at its length (paired Δ, nats/token, 95%):", ""] + out \
        if out else []


def past_window(records: list[dict]) -> list[str]:
    """Single-window cells longer than T split at T: mean NLL [nats/token] of the positions inside the window
    (< T; in chunk mode the same tokens and context as a T-long window's) and past it (≥ T), and the past part's
    paired difference to vanilla (95% block bootstrap over the blocks past T)."""
    rows = sorted((r for r in records if r["length"] > r["train_length"] and r.get("windows") == 1
                   and r.get("nll_by_position") and r.get("nll_blocks")), key=lambda r: r["length"])
    if not rows:
        return []
    base = {r["length"]: r for r in rows if r["strategy"] == "vanilla"}
    out = ["| strategy | length | NLL inside T | NLL past T | past − inside | past T: Δ to vanilla (95%) |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r["train_length"]
        inside = [b for b in r["nll_by_position"] if b["end"] <= t]
        past = [b for b in r["nll_by_position"] if b["start"] >= t]
        a, b = _mean_nll(inside), _mean_nll(past)
        cut = t // r["block_tokens"][0]  # blocks are in position order for one window
        delta = ""
        v = base.get(r["length"])
        if v is not None and r["strategy"] != "vanilla":
            d = paired_delta(_from_block(r, cut), _from_block(v, cut))
            delta = f"{d[0]:+.3f} ({d[1]:+.3f}…{d[2]:+.3f})" if d else ""
        out.append(f"| {r['strategy']} | {r['length']:,} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {delta} |")
    return ["", "Past the window, one window per cell split at T (nats/token; in chunk mode the part inside T is a "
            "T-long window's tokens and context, so it is the cell's perplexity at T: exp of that column):", ""] + out


def kl(records: list[dict]) -> list[str]:
    out = perplexity(records)
    return out + ["", "KL(P_unpatched ‖ P_patched) [nats/token], every scored token / each window's first "
                  f"{records[0].get('kl_first_tokens')} predictions:", ""] + _grid(
        records, lambda r: f"{r['kl']:.4f} / {r['kl_first']:.4f}" if r.get("kl") is not None else "")


def retrieval(records: list[dict]) -> list[str]:
    def cell(r: dict) -> str:
        lo, hi = r["accuracy_ci"]
        clo, chi = r["candidate_accuracy_ci"]
        return (f"{r['accuracy']:.2f} ({lo:.2f}–{hi:.2f}) · {r['candidate_accuracy']:.2f} ({clo:.2f}–{chi:.2f}), "
                f"n = {r['trials']}")

    return _grid(records, cell) + ["", "greedy exact match (95% Wilson) · candidate log-likelihood accuracy "
                                   f"(95% Wilson; chance {records[0]['chance']:g}), n = trials."]


def generation(records: list[dict]) -> list[str]:
    """A generated-answer task's score (JSON KV's substring exact match, GraphWalks' set F1) per cell: a 0/1 score
    with its 95% Wilson interval and count, a graded one with its samples' scores."""
    key = "subem" if records[0]["task"] == "json_kv" else "f1"

    def cell(r: dict) -> str:
        s = r["sample_scores"]
        if key == "subem":  # a 0/1 score per sample
            lo, hi = wilson(int(sum(s)), len(s))
            return f"{r[key]:.0f}% ({100 * lo:.0f}–{100 * hi:.0f}), {int(sum(s))}/{len(s)}"
        return f"{r[key]:.1f} (samples: {', '.join(f'{x:.2f}' for x in s)})"

    what = ("substring exact match, % (95% Wilson), hits/samples" if key == "subem"
            else "set F1 ×100 (lm-eval's; an empty gold set scores 0), each sample's F1")
    return _grid(records, cell) + ["", what + "."]


def ruler(records: list[dict]) -> list[str]:
    def cell(r: dict) -> str:
        if r.get("score") is None:
            return "—"
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted((r.get("scores") or {}).items()))
        return f"**{r['score']:.1f}** ({parts})"

    return _grid(records, cell)


def longppl(records: list[dict]) -> list[str]:
    return _grid(records, lambda r: f"LongPPL {r['longppl']:.2f} · PPL {r['ppl']:.2f} ({r.get('key_tokens', '?')} key "
                                    "tokens)" if r.get("longppl") is not None else "—")


# a fine-tuned model's perplexity folder → the training-free folder of the same data it is compared with
VERSUS = {"smollm2-finetune-yarn/eval/perplexity": "smollm2-perplexity",
          "smollm2-finetune-linear/eval/perplexity": "smollm2-perplexity",
          "smollm2-finetune-yarn-handbook": "smollm2-perplexity-handbook"}


def _same_rule(a: dict, b: dict) -> bool:
    """The same strategy and scale factor (a config's ``yarn:factor=4`` and a sweep's auto ``yarn`` at 4T alike)."""
    return a["name"] == b["name"] and (a.get("params") or {}).get("factor") == (b.get("params") or {}).get("factor")


def versus(tuned: list[dict], free: list[dict]) -> list[str]:
    """Each fine-tuned cell beside the training-free cell of the same rule, factor and length and vanilla's, on the
    same tokens: PPL (95% interval) each, and the paired Δ mean NLL [nats/token] (95% block bootstrap)."""
    out = ["| length | fine-tuned | training-free, same rule | Δ fine-tuned − training-free | vanilla | "
           "Δ fine-tuned − vanilla |", "|---:|---:|---:|---:|---:|---:|"]

    def ppl(r: dict | None) -> str:
        return "" if r is None else f"{r['ppl']:.2f} ({r['ppl_ci'][0]:.2f}–{r['ppl_ci'][1]:.2f})"

    def delta(a: dict, b: dict | None) -> str:
        d = paired_delta(a, b) if b is not None else None
        return f"{d[0]:+.3f} ({d[1]:+.3f}…{d[2]:+.3f})" if d else ""

    for r in sorted(tuned, key=lambda r: r["length"]):
        same = next((f for f in free if f["length"] == r["length"] and _same_rule(f, r)), None)
        van = next((f for f in free if f["length"] == r["length"] and f["name"] == "vanilla"), None)
        out.append(f"| {r['length']:,} | {ppl(r)} | {ppl(same)} | {delta(r, same)} | {ppl(van)} | {delta(r, van)} |")
    factor = (tuned[0].get("params") or {}).get("factor")
    rule = tuned[0]["name"] + (f" ×{factor:g}" if factor else "")
    return ["", f"Fine-tuned against training-free ({rule}), the same tokens:", ""] + out


def table(folder: Path, kind: str) -> list[str]:
    if kind == "finetune":
        out = []
        for sub in sorted((folder / "eval").glob("*")) if (folder / "eval").is_dir() else []:
            records = read_results(sub / "results.jsonl")
            if records:
                out += ["", _caption(sub, records), ""] + (perplexity if records[0]["task"] == "perplexity"
                                                           else retrieval)(records) + _versus(sub, records)
        summary = folder / "model" / "finetune.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            out = [f"fine-tuned: {s.get('steps')} steps, {s.get('tokens', '?')} tokens, "
                   f"{s.get('train_seconds', 0) / 60:.0f} min of training, final loss {s.get('final_loss')}"] + out
        return out
    if kind == "search":
        best = folder / "best.json"
        return [f"best: `{best.read_text().strip()}`"] if best.is_file() else []
    records = read_results(folder / "results.jsonl")
    if not records:
        return []
    fn = {"perplexity": perplexity, "kl": kl, "retrieval": retrieval, "ruler": ruler, "longppl": longppl,
          "generation": generation}[kind]
    return [_caption(folder, records), ""] + fn(records) + _versus(folder, records)


def _versus(folder: Path, records: list[dict]) -> list[str]:
    """``versus`` for a fine-tuned folder named in ``VERSUS`` whose training-free folder is there."""
    root = next((folder.parents[i] for i, _ in enumerate(folder.parents)
                 if folder.relative_to(folder.parents[i]).as_posix() in VERSUS), None)
    if root is None:
        return []
    free = read_results(root / VERSUS[folder.relative_to(root).as_posix()] / "results.jsonl")
    return versus(records, free) if free else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="runs")
    args = ap.parse_args()
    for name, kind in FOLDERS.items():
        folder = Path(args.runs) / name
        lines = table(folder, kind) if folder.is_dir() else []
        print(f"### {name}\n")
        print("\n".join(lines) if lines else f"({folder} not there yet)")
        print()



if __name__ == "__main__":
    main()
