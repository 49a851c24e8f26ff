"""``ropescale inspect``: what each strategy does to a model's rotary geometry at a length.

For a model (its config only: d, ``rope_theta``, training window T and its own frequencies) or a
bare configuration, and each strategy at target length L, writes into the output folder:

- ``wavelengths.png``: λ_i per rotary pair before and after, log axis, T and L marked, each pair
  coloured by its class (``ropescale.geometry.classify_pairs``); relative-position rules instead get
  ``relative_positions.png``, their map p(i, j) at L;
- ``angles.png``: rotation angle mod 2π against distance for chosen pairs (default the fastest),
  short range and 1 … L, with the first aliasing distance (He & Xu, Figs. 1–2);
- ``decay.png``: C(r) = (2/d)·Σ cos(r·θ_i) and the RoFormer bound (Su et al. §3.4.3), r < L;
- ``base_bound.png``: B(m) = Σ cos(m·θ_i) over m < L (Men et al. 2024, arXiv:2405.14591);
- ``attention.png`` (``attention=True``, needs the weights): attention entropy by query position
  and the share of attention on the first tokens, per strategy, on real text of L tokens;
- ``summary.json``: every number above (classes, counts, alias distances, first negative B(m),
  the smallest base that keeps B ≥ 0 up to L for this d, …) and, for a model (its weights
  loaded), ``layers``: per strategy the per-layer report ``patch --dry-run`` prints
  (``layer_reports``: each decoder layer's rope, θ, rotary dim, layout, T and what the patch
  applies there; layers without attention, such as Qwen3.5's linear-attention ones, as "no RoPE").

Raises ``ValueError`` for bad input (unknown strategy or parameter, a length below 2, a model
config without RoPE) with one line saying what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ropescale import geometry as geo
from ropescale.errors import InvalidInput
from ropescale.runs.config import StrategySpec
from ropescale.runs.memory import Need, check_fits
from ropescale.strategies import RopeFrequencies, get_strategy
from ropescale.strategies.frequency import rope_inv_freq

from .config import MAX_LENGTH

GRID = 256  # positions per side of the relative-position figure


def inspect_bytes(dim: int, length: int) -> int:
    """Host memory [bytes] the geometry of one strategy holds at ``length``: the angle tables
    r·θ_i and their cosines over r < L and the d/2 pairs, float64, about four at once (decay curve,
    RoFormer's bound, the base bound and its certified search)."""
    return 4 * length * (dim // 2) * 8

__all__ = ["RotaryConfig", "attention_input", "inspect", "inspected_model", "layer_reports", "rotary_config",
           "rotary_config_of_model", "summary_text"]



@dataclass(frozen=True)
class RotaryConfig:
    """d, b, T and the model's own ``inv_freq`` ``[d/2]`` (vanilla unless its config scales RoPE);
    ``dual_chunk_attention_config``: the model's own (DCA's defaults), None without one."""

    dim: int
    rope_theta: float
    train_length: int
    inv_freq: torch.Tensor
    source: str
    dual_chunk_attention_config: dict | None = None


def rotary_config_of_model(name_or_path: str) -> RotaryConfig:
    """Read d, b, T and the configured frequencies from a model's config (no weights loaded), by
    the reader ``patch`` uses (``ropescale.models.model_rope_config``; Gemma 3: its
    ``full_attention`` layers; Beam, Ergo: their rotating ``sliding_attention`` layers, the
    ``full_attention`` ones being NoPE, named in ``source``). Raises ``ValueError`` in one line for a
    config without RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ropescale.models import model_config, model_rope_config
    from ropescale.rope_config import NoRopeConfigError, nope_layer_types, text_config

    try:
        rope = model_rope_config(name_or_path)
    except NoRopeConfigError as e:
        raise InvalidInput(f"{name_or_path}: {e}") from None
    if rope.original_max_position_embeddings is None:
        raise InvalidInput(f"{name_or_path}: its config has no max_position_embeddings; give the training window")
    rope_type = rope.rope_parameters.get("rope_type", "default")
    text = text_config(model_config(name_or_path))
    if rope_type in ROPE_INIT_FUNCTIONS:  # the model's own scaled frequencies
        inv_freq = ROPE_INIT_FUNCTIONS[rope_type](text, "cpu", layer_type=rope.layer_type)[0].double()
    else:
        inv_freq = rope_inv_freq(rope.dim, rope.rope_theta).double()
    nope = nope_layer_types(text)
    source = str(name_or_path) + (f" ({rope.layer_type} layers; {', '.join(nope)}: NoPE, rope_parameters None)"
                                  if nope else "")
    return RotaryConfig(rope.dim, rope.rope_theta, rope.original_max_position_embeddings, inv_freq, source,
                        rope.dual_chunk_attention_config)


T_FLAG = "--original-max-position-embeddings"  # the CLI's one spelling of the training window T


def rotary_config(model: str | None, head_dim: int | None = None, rope_theta: float | None = None,
                  original_max_position_embeddings: int | None = None) -> RotaryConfig:
    """What ``ropescale inspect`` draws: ``model``'s rotary configuration (``rotary_config_of_model``)
    or, without a model, the bare one of rotary dim d = ``head_dim``, base b = ``rope_theta`` and
    training window T = ``original_max_position_embeddings`` [tokens] with vanilla frequencies. Raises
    ``InvalidInput`` in one line, naming the CLI's flags, for a model and a bare configuration
    both given, a bare one incomplete, or d odd or < 2, b not finite or <= 1, T < 2."""
    bare = {"--head-dim": head_dim, "--rope-theta": rope_theta, T_FLAG: original_max_position_embeddings}
    if model:
        given = [f for f, v in bare.items() if v is not None]
        if given:
            raise InvalidInput(f"{', '.join(given)} describe a bare configuration; with --model the model's own "
                               "config is used: give one or the other")
        return rotary_config_of_model(model)
    missing = [f for f, v in bare.items() if v is None]
    if missing:
        raise InvalidInput(f"give --model, or a bare configuration: missing {', '.join(missing)}")
    t = original_max_position_embeddings
    if head_dim < 2 or head_dim % 2 or not (math.isfinite(rope_theta) and rope_theta > 1) or t < 2:
        raise InvalidInput(f"--head-dim must be even and >= 2, --rope-theta finite and > 1, {T_FLAG} >= 2")
    return RotaryConfig(head_dim, rope_theta, t, rope_inv_freq(head_dim, rope_theta).double(),
                        f"d={head_dim}, b={rope_theta:g}, T={t}")


def attention_input(model: str | None, strategies: list[StrategySpec], data: str, length: int,
                    device: str = "cpu") -> dict[str, Any]:
    """``inspect``'s ``attention=``: ``{"model": the unpatched model, "ids": [1, L] token ids}``,
    the first ``length`` tokens of ``data`` (``ropescale.runs.data``). Raises ``InvalidInput``
    without a model, for a strategy that computes attention in its own kernel (a relative-position rule:
    no attention weights to measure), or for text shorter than ``length``; checked before the
    model's weights are loaded except the last."""
    if not model:
        raise InvalidInput("--attention needs --model (its weights)")
    rules = [s.name for s in strategies if get_strategy(s.name).kind != "frequency"]
    if rules:
        raise InvalidInput(f"--attention needs attention weights; {', '.join(rules)} compute attention in "
                           "their own kernel and return none (measure frequency strategies only)")
    from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

    m, tok = inspected_model(model, device)
    stream = torch.cat(tokenize_documents(tok, load_documents(DataSpec(data))))  # [n] token ids
    if stream.numel() < length:
        raise InvalidInput(f"--data {data} has {stream.numel()} tokens, fewer than --length {length}")
    return {"model": m, "ids": stream[:length][None]}  # [1, L]


def inspected_model(model: str, device: str = "cpu"):
    """``(model, tokenizer)``: ``model`` loaded with its weights (``ropescale.load_model``) and
    without a patch it was saved with — what the per-layer reports and ``--attention`` read."""
    from ropescale import load_model, unpatch

    m, tok = load_model(model, device=device)
    unpatch(m)
    return m, tok


def layer_reports(model, strategies: list[StrategySpec], params: list[dict]) -> dict[str, Any]:
    """Per strategy (its display name): what ``ropescale.patch`` does at each decoder layer of the
    loaded, unpatched ``model`` with ``params`` (the parameters the geometry used) — the rows of
    ``PatchHandle.report()``, which ``patch --dry-run`` prints, the layers without attention
    (linear attention, Mamba) as "no RoPE" rows —, or ``{"refused": message}`` where the patch
    refuses the strategy on this model. The model is left unpatched."""
    from ropescale import patch
    from ropescale.errors import RopescaleError

    out: dict[str, Any] = {}
    for spec, values in zip(strategies, params):
        try:
            with patch(model, spec.name, logn=spec.logn, temperature=spec.temperature, **values) as handle:
                out[spec.display] = handle.report()
        except (RopescaleError, ValueError) as e:
            out[spec.display] = {"refused": " ".join(str(e).split())}
    return out


def summary_text(summary: dict[str, Any], output: str | Path) -> str:
    """``inspect``'s summary as the lines ``ropescale inspect`` prints: the configuration, per
    strategy its pair classes, first aliasing distance and first B(m) < 0 (a relative-position rule: its
    largest relative position), the smallest base for L and the files written to ``output``."""
    length = summary["length"]
    lines = [f"{summary['source']}: d={summary['dim']}, rope_theta={summary['rope_theta']:g}, "
             f"T={summary['train_length']}, L={length}"]
    for r in summary["strategies"]:
        if r["kind"] == "frequencies":
            counts = ", ".join(f"{k} {v}" for k, v in r["class_counts"].items() if v)
            lines.append(f"  {r['strategy']:<28} pairs: {counts}; aliasing at r = {r['alias_distance']}; "
                         f"first B(m) < 0 at m = {r['base_bound_first_negative']}")
        else:
            groups = r.get("max_relative_position_per_group")
            per = f"; per pair group, fastest first: {', '.join(f'{x:g}' for x in groups)}" if groups else ""
            lines.append(f"  {r['strategy']:<28} relative positions up to {r['max_relative_position']:g} "
                         f"(window {r['window']}{per})")
    lines.append(f"  smallest base keeping B(m) >= 0 for m < {length} at d = {summary['dim']}: "
                 f"{summary['smallest_base_for_length']:.4g}")
    lines.append(f"written to {output}/: {', '.join(summary['files'])}, summary.json")
    return "\n".join(lines) + "\n"


def _frequencies(spec: StrategySpec, cfg: RotaryConfig, length: int):
    strat = get_strategy(spec.name)
    params = spec.resolve(length=length, train_length=cfg.train_length,
                          context={"dual_chunk_attention_config": cfg.dual_chunk_attention_config})
    context = {"dim": cfg.dim, "rope_theta": cfg.rope_theta, "original_max_position_embeddings": cfg.train_length,
               "seq_len": length, "dual_chunk_attention_config": cfg.dual_chunk_attention_config}
    return params, strat.compute(context, params)


def _strategy_summary(spec: StrategySpec, cfg: RotaryConfig, length: int, pairs: list[int]) -> dict[str, Any]:
    params, out = _frequencies(spec, cfg, length)
    record: dict[str, Any] = {"strategy": spec.display, "name": spec.name, "params": params}
    if not isinstance(out, RopeFrequencies):  # a relative-position rule: relative positions, not frequencies
        # the map on a grid of at most GRID × GRID positions (what the figure shows), never [L, L]
        grid = torch.arange(0, length, -(-length // GRID), dtype=torch.float64)[None]  # [1, g], g ≤ GRID
        p = out.relative_positions(grid, grid)[0]  # [g, g], or [g, g, G] per pair group (DPE)
        p = (p.permute(2, 0, 1) if p.dim() == 3 else p).tril()  # [g, g] or [G, g, g]
        # the largest position attention sees is on the last query's row: [1, L], O(L)
        last = out.relative_positions(torch.tensor([[length - 1.0]], dtype=torch.float64),
                                      torch.arange(length, dtype=torch.float64)[None])
        record |= {"kind": "relative rule", "window": out.window, "max_relative_position": float(last.max()),
                   "_p": p}
        if last.dim() == 4:  # per pair group, the fastest pairs first
            record["max_relative_position_per_group"] = last[0, 0].amax(0).tolist()
        return record
    theta = out.inv_freq.double()
    classes = geo.classify_pairs(cfg.inv_freq, theta, cfg.train_length, length)
    b = geo.base_bound_curve(theta, length)
    return record | {
        "kind": "frequencies", "attention_factor": out.attention_factor, "inv_freq": theta.tolist(),
        "wavelength": [round(x, 4) if math.isfinite(x) else None for x in geo.wavelengths(theta).tolist()],
        "classes": classes, "class_counts": {c: classes.count(c) for c in geo.PAIR_CLASSES},
        "alias_distance": {str(i): geo.alias_distance(float(theta[i]), length) for i in pairs},
        "base_bound_first_negative": geo.first_negative(b), "base_bound_min": float(b.min()),
        "_theta": theta}


def inspect(cfg: RotaryConfig, strategies: list[StrategySpec], length: int, output: str | Path, *,
            pairs: list[int] | None = None, attention: dict | None = None,
            load_model: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Compute and draw the geometry of ``strategies`` at ``length``; returns the summary.

    ``pairs``: rotary pairs for the angle plot (default ``[0]``, the fastest). ``attention``:
    ``{"model": ..., "text": ...}`` to also measure attention statistics (see module doc).
    ``load_model``: returns the loaded, unpatched model (``inspected_model``) whose per-layer
    reports (``layer_reports``) the summary holds as ``layers``; called once the input is checked
    (bad input is refused before any weights load).
    """
    if length < 2:
        raise InvalidInput(f"length {length} must be at least 2 tokens")
    if length > MAX_LENGTH:
        raise InvalidInput(f"length {length} is beyond any model: RoPE angles come from float32 positions, exact "
                           f"only up to 2^24 = {MAX_LENGTH} tokens; use a length of at most {MAX_LENGTH}")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 1):
        raise InvalidInput(f"rope_theta {cfg.rope_theta} must be a finite number above 1")
    check_fits(Need(f"inspect at L = {length} tokens, d = {cfg.dim}",
                    host={"angle tables": inspect_bytes(cfg.dim, length)}), "cpu", hint="use a shorter length")
    pairs = pairs or [0]
    bad = [i for i in pairs if not 0 <= i < cfg.dim // 2]
    if bad:
        raise InvalidInput(f"pairs {bad} out of range: this model has {cfg.dim // 2} rotary pairs "
                           f"(0 … {cfg.dim // 2 - 1})")
    rows = [_strategy_summary(s, cfg, length, pairs) for s in strategies]  # every strategy checked: nothing written yet
    layers = layer_reports(load_model(), strategies, [r["params"] for r in rows]) if load_model else None
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    b_min = geo.smallest_base(cfg.dim, length)
    summary = {"source": cfg.source, "dim": cfg.dim, "rope_theta": cfg.rope_theta, "train_length": cfg.train_length,
               "length": length, "pairs": pairs, "smallest_base_for_length": b_min,
               "rope_theta_keeps_B_nonnegative": cfg.rope_theta >= b_min,
               "strategies": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    from .inspect_plots import plot_all

    summary["files"] = plot_all(cfg, rows, length, pairs, output)
    if attention:
        from .inspect_plots import attention_stats, plot_attention

        stats = {r["strategy"]: attention_stats(attention["model"], attention["ids"], s)
                 for r, s in zip(rows, strategies)}
        plot_attention(stats, cfg, length, output / "attention.png")
        summary["attention"] = {k: {"mean_entropy": v["mean_entropy"], "mean_sink_share": v["mean_sink_share"]}
                                for k, v in stats.items()}
        summary["files"].append("attention.png")
    if layers is not None:
        summary["layers"] = layers
    (output / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


MAX_DIM = 1 << 16  # rotary dims d: the largest models' heads are 256 wide
BASE_CEILING = 1e12  # the largest base searched


def check_base_bound(dims: list[int], lengths: list[int]) -> None:
    """Every head dim an even number in [2, ``MAX_DIM``], every length in [2, ``MAX_LENGTH``], and
    the largest cell's tables (``inspect_bytes``) within this machine's free memory. Raises
    ``InvalidInput`` (``InsufficientMemoryError``) in one line, before anything is computed."""
    bad = [d for d in dims if not (isinstance(d, int) and 2 <= d <= MAX_DIM and d % 2 == 0)]
    if bad or not dims:
        raise InvalidInput(f"dims: {', '.join(map(str, bad)) or 'none given'}: a rotary dim d is an even number "
                           f"from 2 to 2^16 = {MAX_DIM}")
    bad = [n for n in lengths if not (isinstance(n, int) and 2 <= n <= MAX_LENGTH)]
    if bad or not lengths:
        raise InvalidInput(f"lengths: {', '.join(map(str, bad)) or 'none given'}: a length L is from 2 to 2^24 = "
                           f"{MAX_LENGTH} tokens (RoPE angles come from float32 positions, exact only up to there)")
    d, n = max(dims), max(lengths)
    check_fits(Need(f"base-bound at L = {n} tokens, d = {d}", host={"B(m) tables": inspect_bytes(d, n)}), "cpu",
               hint="ask for fewer tokens or a smaller d")


def base_bound_table(dims: list[int], lengths: list[int], paper_fit: bool = True) -> str:
    """Markdown: the smallest vanilla base keeping B(m) ≥ 0 for m < L, per head dim d and L;
    beside d = 128 the power law Men et al. fit to their own values (Fig. 1: 0.0424·L^1.628).
    A cell no base reaches (d = 2: B(m) = cos m whatever the base, negative from m = 2) is
    "—", explained under the table. Raises ``InvalidInput`` for dims or lengths out of range or
    too large for memory (``check_base_bound``)."""
    check_base_bound(dims, lengths)
    head = "| L | " + " | ".join(f"d = {d}" for d in dims) + (" | paper's fit, d = 128 |" if paper_fit else " |")
    rows = [head, "|---:|" + "---:|" * (len(dims) + int(paper_fit))]
    none_passes = False
    for n in lengths:
        vals = []
        for d in dims:
            try:
                vals.append(f"{geo.smallest_base(d, n, high=BASE_CEILING):.3g}")
            except InvalidInput:  # no base up to the search's ceiling keeps B(m) >= 0
                vals.append("—")
                none_passes = True
        rows.append(f"| {n} | " + " | ".join(vals) + (f" | {0.0424 * n ** 1.628:.3g} |" if paper_fit else " |"))
    if none_passes:
        rows += ["", f"—: no base up to {BASE_CEILING:g} keeps B(m) >= 0 for every m < L at this d (at d = 2, "
                     "B(m) = cos m for every base: negative from m = 2)."]
    return "\n".join(rows) + "\n"
