"""Figures of ``ropescale inspect`` (``eval.inspect`` computes, this module draws), and the
optional attention statistics measured on a model."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ropescale import geometry as geo
from ropescale.errors import InvalidInput
from ropescale.patching import find_rotary_modules, patch, rope_context
from ropescale.runs.plotting import line_style, pyplot, save_figure
from ropescale.strategies import get_strategy

SINK_TOKENS = 4  # "the first tokens" whose share of attention is reported

__all__ = ["attention_stats", "plot_all", "plot_attention"]

_CLASS_COLOURS = {"unchanged": "tab:green", "interpolated": "tab:blue", "extrapolated": "tab:red",
                  "truncated": "black"}


def _save(fig, path: Path) -> None:
    save_figure(fig, path, rect=(0, 0, 1, 0.97), bbox_tight=True)  # room for the suptitle


def _title(cfg, length: int) -> str:
    return f"{cfg.source}: d = {cfg.dim}, b = {cfg.rope_theta:g}, T = {cfg.train_length}, L = {length}"


def plot_wavelengths(cfg, rows: list[dict], length: int, path: Path) -> None:
    """Wavelength per rotary pair before and after each strategy, pairs coloured by class
    (unchanged, interpolated, extrapolated, truncated).

    Args:
        cfg: the inspected model's rotary settings (``eval.inspect``).
        rows: one row per strategy (``eval.inspect``).
        length: the target length L [tokens].
        path: the PNG written.
    """
    plt = pyplot()
    n = len(rows)
    cols = min(3, n)
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(4.6 * cols, 3.6 * -(-n // cols)), squeeze=False)
    before = geo.wavelengths(cfg.inv_freq)
    idx = list(range(cfg.dim // 2))
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, r in zip(axes.flat, rows):
        ax.plot(idx, before.tolist(), color="grey", lw=1, label="model")
        after = [w if w is not None else float("nan") for w in r["wavelength"]]
        top = max([x for x in after if not math.isnan(x)] + before.tolist()) * 3
        for cls, colour in _CLASS_COLOURS.items():
            pts = [(i, after[i] if not math.isnan(after[i]) else top) for i in idx if r["classes"][i] == cls]
            if pts:
                ax.scatter(*zip(*pts), s=14, color=colour, label=f"{cls} ({len(pts)})",
                           marker="x" if cls == "truncated" else "o", zorder=3)
        ax.axhline(cfg.train_length, color="black", ls="--", lw=0.8)
        ax.axhline(length, color="tab:purple", ls=":", lw=0.8)
        ax.annotate("T", (0, cfg.train_length), xytext=(2, 2), textcoords="offset points", fontsize=7)
        ax.annotate("L", (0, length), xytext=(2, 2), textcoords="offset points", fontsize=7, color="tab:purple")
        ax.set_yscale("log")
        ax.set_title(r["strategy"], fontsize=9)
        ax.set_xlabel("rotary pair i", fontsize=8)
        ax.set_ylabel("wavelength λ_i (tokens)", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle("wavelength per rotary pair (truncated pairs drawn at the top) — " + _title(cfg, length), fontsize=9)
    _save(fig, path)


def plot_relative_positions(cfg, rows: list[dict], length: int, path: Path) -> None:
    """The relative position each (query, key) pair is given, per relative-position rule.

    Args:
        cfg: the inspected model's rotary settings (``eval.inspect``).
        rows: one row per strategy, with its map on a grid.
        length: the target length L [tokens].
        path: the PNG written.
    """
    plt = pyplot()
    maps = []  # (title, map [≤256, ≤256] on a grid (eval.inspect)): a rule per pair group draws one per group
    for r in rows:
        p = r["_p"]
        if p.dim() == 3:  # [G, g, g]
            maps += [(f"{r['strategy']}, pair group {k} (window {r['window']})", p[k]) for k in range(p.shape[0])]
        else:
            maps.append((f"{r['strategy']} (window {r['window']})", p))
    fig, axes = plt.subplots(1, len(maps), figsize=(4.2 * len(maps), 3.8), squeeze=False)
    for ax, (title, p) in zip(axes[0], maps):
        im = ax.imshow(p.numpy(), cmap="viridis", origin="upper", extent=(0, length, length, 0))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position j", fontsize=8)
        ax.set_ylabel("query position i", fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8, label="p(i, j)")
    fig.suptitle("relative position attention sees, j ≤ i — " + _title(cfg, length), fontsize=9)
    _save(fig, path)


def plot_angles(cfg, rows: list[dict], length: int, pairs: list[int], path: Path) -> None:
    """The rotation angle of chosen pairs against position, per strategy.

    Args:
        cfg: the inspected model's rotary settings (``eval.inspect``).
        rows: one row per strategy.
        length: the target length L [tokens].
        pairs: the rotary pairs drawn.
        path: the PNG written.
    """
    plt = pyplot()
    short = min(length, 32)
    fig, axes = plt.subplots(len(pairs), 2, figsize=(12, 3.4 * len(pairs)), squeeze=False)
    for (ax_s, ax_l), i in zip(axes, pairs):
        for k, r in enumerate(rows):
            theta = float(r["_theta"][i])
            ang = geo.rotation_angles(theta, length)
            style = line_style(k, len(rows)) | {"ms": 3}
            alias = r["alias_distance"][str(i)]
            label = f"{r['strategy']} (θ = {theta:.3g}; aliasing at r = {alias})" if alias else \
                f"{r['strategy']} (θ = {theta:.3g}; monotone to L)"
            ax_s.plot(range(1, short), ang[1:short].tolist(), label=label, **style)
            ax_l.plot(range(1, length), ang[1:].tolist(), lw=0.8, color=style["color"])
        for ax, title in ((ax_s, f"pair {i}: distances 1 … {short - 1}"),
                          (ax_l, f"pair {i}: distances 1 … {length - 1}")):
            ax.axhline(math.pi / 2, color="grey", ls=":", lw=0.8)
            ax.set_ylim(0, 2 * math.pi)
            ax.set_xlabel("distance r (tokens)", fontsize=8)
            ax.set_ylabel("r·θ_i mod 2π (rad)", fontsize=8)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        ax_s.legend(fontsize=7)
    fig.suptitle("rotation angle against distance — " + _title(cfg, length), fontsize=9)
    _save(fig, path)


def plot_decay(cfg, rows: list[dict], length: int, path: Path) -> None:
    """Long-term decay, per strategy: C(r) = (2/d)·Σ_i cos(r·θ_i) against the distance r, and
    RoFormer's relative upper bound (``ropescale.geometry``).

    Args:
        cfg: the inspected model's rotary settings (``eval.inspect``).
        rows: one row per strategy.
        length: the target length L [tokens].
        path: the PNG written.
    """
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2))
    for k, r in enumerate(rows):
        style = {"color": line_style(k, len(rows))["color"], "lw": 1, "label": r["strategy"]}
        a.plot(geo.decay_curve(r["_theta"], length).tolist(), **style)
        b.plot(geo.roformer_bound(r["_theta"], length).tolist(), **style)
    for ax, ylabel, title in ((a, "C(r) = (2/d) Σ cos(r θ_i)", "long-range decay of the mean cosine"),
                              (b, "(2/d) Σ_j |S_j(r)|", "RoFormer relative upper bound (§3.4.3)")):
        ax.axvline(cfg.train_length, color="black", ls="--", lw=0.8)
        ax.set_xscale("symlog", linthresh=16)
        ax.set_xlim(0, length)
        ax.set_xlabel("relative distance r (tokens)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    b.legend(fontsize=7, loc="upper right")
    fig.suptitle(_title(cfg, length), fontsize=9)
    _save(fig, path)


def plot_base_bound(cfg, rows: list[dict], length: int, path: Path) -> None:
    """B(m) = Σ_i cos(m·θ_i) per strategy (the base bound, arXiv:2405.14591), its first negative
    distance marked.

    Args:
        cfg: the inspected model's rotary settings (``eval.inspect``).
        rows: one row per strategy.
        length: the target length L [tokens].
        path: the PNG written.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, r in enumerate(rows):
        neg = r["base_bound_first_negative"]
        ax.plot(geo.base_bound_curve(r["_theta"], length).tolist(), lw=1, color=line_style(k, len(rows))["color"],
                label=(f"{r['strategy']} (first B < 0 at m = {neg})" if neg is not None
                       else f"{r['strategy']} (B ≥ 0 up to L)"))
    ax.axhline(0, color="black", lw=0.8)
    ax.axvline(cfg.train_length, color="black", ls="--", lw=0.8)
    ax.set_xscale("symlog", linthresh=16)
    ax.set_xlim(0, length)
    ax.set_xlabel("distance m (tokens)", fontsize=8)
    ax.set_ylabel("B(m) = Σ_i cos(m θ_i)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title("base bound (Men et al. 2024) — " + _title(cfg, length), fontsize=9)
    _save(fig, path)


def plot_all(cfg, rows: list[dict], length: int, pairs: list[int], output: Path) -> list[str]:
    """Every figure that applies; returns the file names written."""
    freq = [r for r in rows if r["kind"] == "frequencies"]
    rules = [r for r in rows if r["kind"] != "frequencies"]
    files = []
    if freq:
        plot_wavelengths(cfg, freq, length, output / "wavelengths.png")
        plot_angles(cfg, freq, length, pairs, output / "angles.png")
        plot_decay(cfg, freq, length, output / "decay.png")
        plot_base_bound(cfg, freq, length, output / "base_bound.png")
        files += ["wavelengths.png", "angles.png", "decay.png", "base_bound.png"]
    if rules:
        plot_relative_positions(cfg, rules, length, output / "relative_positions.png")
        files.append("relative_positions.png")
    return files


def current_train_length(model) -> int:
    """The model's training window T, as ``patch`` reads it."""
    (_, module), *_ = find_rotary_modules(model)
    return rope_context(model, module)["original_max_position_embeddings"]


@torch.no_grad()
def attention_stats(model, ids: torch.Tensor, spec) -> dict:
    """Attention entropy [nats] and the share of attention on the first ``SINK_TOKENS`` keys, by
    query position, averaged over heads and layers, with ``spec``'s strategy patched in. Needs
    eager attention weights: frequency strategies (and log-n) only."""
    strat = get_strategy(spec.name)
    if strat.kind != "frequency":
        raise InvalidInput(f"attention statistics need attention weights; {strat.name} computes attention in its "
                         "own kernel and returns none (measure frequency strategies only)")
    length, train = ids.shape[1], current_train_length(model)
    params = spec.resolve(length=length, train_length=train)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with patch(model, strat.name, logn=spec.logn, temperature=spec.temperature, **params):
            att = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(before)
    a = torch.stack([x[0].double() for x in att])  # [layers, heads, s, s]
    entropy = -(a * a.clamp_min(1e-30).log()).sum(-1).mean((0, 1))  # [s]
    sink = a[..., :SINK_TOKENS].sum(-1).mean((0, 1))  # [s]
    return {"entropy": entropy.tolist(), "sink_share": sink.tolist(),
            "mean_entropy": float(entropy.mean()), "mean_sink_share": float(sink.mean())}


def plot_attention(stats: dict, cfg, length: int, path: Path) -> None:
    """Attention statistics measured on the model per strategy: entropy [nats] and the share of
    attention on the first ``SINK_TOKENS`` keys, per query position.

    Args:
        stats: ``{strategy: statistics}`` (``attention_stats``).
        cfg: the inspected model's rotary settings (``eval.inspect``).
        length: the sequence length [tokens].
        path: the PNG written.
    """
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2))
    for k, (name, s) in enumerate(stats.items()):
        colour = line_style(k, len(stats))["color"]
        a.plot(s["entropy"], lw=0.8, color=colour, label=name)
        b.plot(s["sink_share"], lw=0.8, color=colour, label=name)
    a.plot([math.log(i + 1) for i in range(length)], color="grey", ls=":", lw=0.8, label="uniform (ln(i+1))")
    for ax, ylabel in ((a, "attention entropy (nats)"), (b, f"share of attention on the first {SINK_TOKENS} tokens")):
        ax.axvline(cfg.train_length, color="black", ls="--", lw=0.8)
        ax.set_xlabel("query position", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle("attention by query position, mean over heads and layers — " + _title(cfg, length), fontsize=9)
    _save(fig, path)
