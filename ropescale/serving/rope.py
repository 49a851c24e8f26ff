"""What a serving engine rotates by, and whether it is what ropescale rotates by.

An ``EngineRope`` is one engine's rotary embedding for one served length: per-pair angular
frequencies, the cos/sin magnitude and the softmax scale. ``ropescale_rope`` reads it from a
patched model, each engine's ``rope`` (``ropescale.serving.engines``: ``vllm_rope``,
``llama_cpp_rope``) from an exported config re-implementing that engine's formulas, and
``compare`` says whether two agree. A per-layer-type model (Gemma 3) has one per layer type:
``ropescale_layer_ropes`` (patched types and the types kept as shipped) against an engine's
per-type ``rope``, compared by ``compare_layers``.

Shapes: d = rotary dim (even), d/2 = rotary pairs. Units: frequencies in radians per token,
lengths in tokens, angles in radians.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ropescale.errors import InvalidInput, RopescaleError
from ropescale.patching import PatchHandle, current_patch
from ropescale.rotary import attention_scaling_of, find_rotary_modules, inv_freq_name, layer_types_of
from ropescale.rotary.quirks import model_softmax_scale
from ropescale.temperature import NATIVE, Temperature

__all__ = ["FREQ_TOL", "MAGNITUDE_TOL", "MAX_LENGTH", "EngineRope", "ExportRefused", "Verdict", "check_length",
           "compare", "compare_layers", "model_ropes", "patch_handle", "ropescale_layer_ropes", "ropescale_rope",
           "served_temperatures", "temperature_label"]

# the longest length served, exported or compared [tokens]: RoPE angles come from float32 positions,
# exact integers only up to 2^24 (the harness's lengths have the same bound: eval.config.MAX_LENGTH)
MAX_LENGTH = 1 << 24
FREQ_TOL = 1e-5  # largest relative frequency difference called "same" (float32 arithmetic on both sides)
MAGNITUDE_TOL = 1e-6  # largest cos/sin magnitude difference called "same"


class ExportRefused(RopescaleError, ValueError):
    """An engine cannot express a patch; the message names the engine and the reason (one line)."""


@dataclass(frozen=True)
class EngineRope:
    """What an engine computes for one served length.

    inv_freq: ``[d/2]`` float64, θ_i of rotary pair i [radians per token] (position p of pair i
        is rotated by p·θ_i).
    magnitude: the factor cos and sin are multiplied by (YaRN's / LongRoPE's attention factor;
        attention logits scale by its square).
    softmax_scale: multiplier on the usual 1/√head_dim softmax scale: DeepSeek's YaRN mscale(s,
        mscale_all_dim)² where the attention applies it, log-n's factor of the last position; else 1.0.
    temperature: the query temperature of the rotating layers (``temperature_label``: "" for none), or
        None where the engine's is not modelled (not compared).
    note: how the numbers were obtained (engine, formula, quirks met).
    failure: what the engine does instead of computing these numbers at this length (refuses
        it, returns NaN past its cos/sin cache, aborts loading), or None when it serves it.
    """

    inv_freq: torch.Tensor
    magnitude: float
    softmax_scale: float = 1.0
    note: str = ""
    failure: str | None = None
    temperature: str | None = None


def temperature_label(rules, original_max_position_embeddings: int) -> str:
    """How ``EngineRope.temperature`` names the query-temperature ``rules`` (``Temperature`` objects) at
    T = ``original_max_position_embeddings``: ``beta=0.1/T=16384`` (1 + β·ln(1 + ⌊p/T⌋)), another rule by its
    spec, several joined by `` × ``; "" for none."""
    out = []
    for t in rules:
        if t.kind == "beta":
            out.append(f"beta={t.params.get('beta', 0.1):g}/T={int(original_max_position_embeddings)}")
        else:
            out.append(t.spec())
    return " × ".join(out)


@dataclass(frozen=True)
class Verdict:
    """``compare``'s answer for one length L.

    rel_freq_diff: ``[d/2]`` float64, |θ_i − θ'_i| / θ_i (absolute where θ_i = 0).
    max_rel_freq_diff: its largest value; magnitude_diff, softmax_scale_diff: absolute differences.
    max_angle_diff: max_i |θ_i − θ'_i|·(L − 1) [radians], the largest rotation difference reached
        inside the served length.
    same: within ``FREQ_TOL`` relative frequency and ``MAGNITUDE_TOL`` magnitude, and served.
    verdict: ``"same"`` or ``"differs: <why>"`` (a note may follow ``same`` in parentheses).
    """

    length: int
    rel_freq_diff: torch.Tensor
    max_rel_freq_diff: float
    magnitude_diff: float
    softmax_scale_diff: float
    max_angle_diff: float
    same: bool
    verdict: str


def check_length(value, name: str = "serve_length") -> int:
    """``value`` as a whole number of tokens in [2, ``MAX_LENGTH`` = 2^24]; ``InvalidInput`` (one
    line) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidInput(f"{name}={value!r} must be a whole number of tokens >= 2")
    if value > MAX_LENGTH:
        raise InvalidInput(f"{name}={value} tokens is beyond any model: RoPE angles come from float32 positions, "
                           f"exact only up to 2^24 = {MAX_LENGTH} tokens; use a length of at most {MAX_LENGTH}")
    return value


def patch_handle(model_or_handle) -> PatchHandle:
    """The ``PatchHandle`` given, or the active patch of a model; ``InvalidInput`` when unpatched."""
    if isinstance(model_or_handle, PatchHandle):
        handle = model_or_handle
    else:
        handle = current_patch(model_or_handle)
    if handle is None or not handle.active:
        raise InvalidInput("model is not patched; call ropescale.patch(model, ...) first")
    return handle


def ropescale_rope(model_or_handle, length: int, layer_type: str | None = None) -> EngineRope:
    """What the patched ropescale model computes at sequence length L = ``length`` [tokens].

    The patch's strategy evaluated in the rotary context of ``layer_type`` (default: the first
    patched type) exactly as the patched rotary module does (``ropescale.rotary``): a dynamic
    strategy at L rounded up to whole ``dynamic_block`` blocks. With log-n, ``softmax_scale`` is
    the factor of the last position, max(1, ln L / ln T) (Su 2023; it grows with position, which
    no engine config expresses).

    Raises ``InvalidInput`` for an unpatched model, a bad length, or a relative-position rule
    (its rotation depends on the query–key distance, not on one ``inv_freq``).
    """
    handle = patch_handle(model_or_handle)
    length = check_length(length, "length")
    strat = handle.strategy_obj
    if strat.keeps_model:
        ropes = model_ropes(handle.model, length, softmax_scale=model_softmax_scale(handle.model))
        lt = next(iter(ropes)) if layer_type is None else layer_type
        if lt not in ropes:
            raise InvalidInput(f"layer type {lt!r}: the model's rotary module has {list(ropes)}")
        return dataclasses.replace(ropes[lt], temperature=_temperature(handle, lt))
    if strat.kind != "frequency":
        raise InvalidInput(f"{strat.name} is a relative-position rule applied inside attention: it has no single "
                           "inv_freq to compare")
    lt = handle.layer_types[0] if layer_type is None else layer_type
    if lt not in handle.contexts:
        raise InvalidInput(f"layer type {lt!r} is not patched; patched: {handle.layer_types}")
    ctx = handle.contexts[lt]
    at = length
    if strat.dynamic:
        block = handle.options.get("dynamic_block", 1)
        at = -(-length // block) * block
    inv_freq, magnitude = strat.compute({**ctx, "seq_len": at}, handle.params)
    softmax = strat.softmax_scale(handle.params)  # DeepSeek's YaRN mscale², as the patched attention applies it
    note = f"ropescale {handle.strategy} at L={length}"
    if handle.options.get("logn"):
        softmax *= max(1.0, math.log(length) / math.log(ctx["original_max_position_embeddings"]))
        note += "; log-n scale of the last position"
    return EngineRope(inv_freq.detach().to(torch.float64).cpu(), float(magnitude), softmax, note,
                      temperature=_temperature(handle, lt))


def served_temperatures(handle: PatchHandle) -> list[Temperature]:
    """The query temperatures the patched model's RoPE layers apply: the model's own where the patch keeps
    it (``native``, ``temperature="native"``; Mistral's β is removed by any other strategy), then the
    patch's rule (log-n, β, Llama 4's)."""
    out = []
    own = getattr(handle, "own_temperature", {}).get(True)
    removed = (own is not None and own.kind == "beta" and not handle.strategy_obj.keeps_model
               and handle.options.get("temperature") != NATIVE)
    if own is not None and not removed:
        out.append(own)
    if getattr(handle, "temperature", None) is not None:
        out.append(handle.temperature)
    return out


def _temperature(handle: PatchHandle, layer_type: str | None) -> str:
    """``temperature_label`` of the patched RoPE layers' query temperatures (``served_temperatures``), at
    the T of ``layer_type``'s context (the patched one's)."""
    ctx = handle.contexts.get(layer_type) or handle.context
    return temperature_label(served_temperatures(handle), ctx["original_max_position_embeddings"])


@torch.no_grad()
def model_ropes(model, length: int, *, softmax_scale: float = 1.0) -> dict[str | None, EngineRope]:
    """What the model as loaded rotates by at L = ``length`` [tokens], per layer type of its (first)
    rotary module (``{None: ...}`` for one set): the module run once over positions 0 … L−1, so a
    dynamic or LongRoPE module updates as in a forward of L tokens, then its ``inv_freq`` ``[d/2]``
    and ``attention_scaling`` read; ``softmax_scale``: the attention's factor, as observed
    (``ropescale.rotary.quirks.model_softmax_scale``). What a strategy that keeps the model
    (``native``) serves."""
    modules = find_rotary_modules(model)
    if not modules:
        raise InvalidInput("the model has no rotary module")
    _, module = modules[0]
    out = {}
    for lt in layer_types_of(module):
        buf = module._buffers[inv_freq_name(lt)]
        x = torch.zeros(1, length, 1, dtype=torch.float32, device=buf.device)
        positions = torch.arange(length, device=buf.device)[None]
        module(x, positions) if lt is None else module(x, positions, lt)
        inv = module._buffers[inv_freq_name(lt)].detach().to(torch.float64).cpu()
        out[lt] = EngineRope(inv, attention_scaling_of(module, lt), softmax_scale,
                             f"the model's own rotary module{f' ({lt} layers)' if lt else ''} at L={length}")
    return out


def compare(ours: EngineRope, theirs: EngineRope, length: int) -> Verdict:
    """Whether ``theirs`` (an engine) computes ``ours`` (ropescale) up to length L = ``length``.

    ``same`` needs every pair within ``FREQ_TOL`` = 1e-5 relative frequency, the magnitude within
    ``MAGNITUDE_TOL`` = 1e-6, equal softmax scales (within 1e-6) and no engine ``failure``;
    otherwise ``verdict`` is ``"differs: "`` and every reason found (failure, worst pair, magnitudes).
    Raises ``InvalidInput`` for a bad length.
    """
    length = check_length(length, "length")
    a, b = ours.inv_freq.to(torch.float64), theirs.inv_freq.to(torch.float64)
    reasons = []
    if theirs.failure:
        reasons.append(theirs.failure)
    if a.shape != b.shape:
        reasons.append(f"rotary pairs differ ({a.numel()} vs {b.numel()})")
        rel = torch.full((a.numel(),), math.inf, dtype=torch.float64)
        angle = math.inf
    else:
        diff = (a - b).abs()
        rel = torch.where(a != 0, diff / a.abs().clamp_min(1e-300), diff)
        rel = torch.where(torch.isnan(b), torch.full_like(rel, math.inf), rel)
        angle = float(diff.nan_to_num(math.inf).max()) * (length - 1) if diff.numel() else 0.0
    max_rel = float(rel.max()) if rel.numel() else 0.0
    if max_rel > FREQ_TOL:
        i = int(rel.argmax())
        reasons.append(f"frequencies differ by up to {max_rel:.3g} relative (pair {i}: "
                       f"{float(a[i]):.6g} vs {float(b[i]) if i < b.numel() else math.nan:.6g} rad/token; "
                       f"{angle:.3g} rad by position {length - 1})")
    mag = abs(ours.magnitude - theirs.magnitude)
    if not mag <= MAGNITUDE_TOL:
        reasons.append(f"cos/sin magnitude {ours.magnitude:.7g} vs {theirs.magnitude:.7g}")
    soft = abs(ours.softmax_scale - theirs.softmax_scale)
    if not soft <= 1e-6:
        reasons.append(f"softmax scale {ours.softmax_scale:.7g} vs {theirs.softmax_scale:.7g}")
    if None not in (ours.temperature, theirs.temperature) and ours.temperature != theirs.temperature:
        reasons.append(f"query temperature {ours.temperature or 'none'} vs {theirs.temperature or 'none'}")
    same = not reasons
    verdict = "same" if same else "differs: " + "; ".join(reasons)
    return Verdict(length, rel, max_rel, mag, soft, angle, same, verdict)


def ropescale_layer_ropes(model_or_handle, length: int) -> dict[str | None, EngineRope]:
    """What the patched model computes at L = ``length`` [tokens] per layer type of its rotary module:
    the patched types (``ropescale_rope``) first, then the types the patch kept, read from the
    module's own buffers (``{lt}_inv_freq`` ``[d/2]``, ``{lt}_attention_scaling``): exactly what
    those layers rotate by. ``{None: ropescale_rope(...)}`` for a model with one set. Raises as
    ``ropescale_rope``."""
    handle = patch_handle(model_or_handle)
    if handle.strategy_obj.keeps_model:
        return model_ropes(handle.model, check_length(length, "length"),
                           softmax_scale=model_softmax_scale(handle.model))
    if handle.layer_types == [None]:
        return {None: ropescale_rope(handle, length)}
    out: dict[str | None, EngineRope] = {lt: ropescale_rope(handle, length, lt) for lt in handle.layer_types}
    for _, module in find_rotary_modules(handle.model):
        for lt in layer_types_of(module):
            if lt in out:
                continue
            inv = getattr(module, f"{lt}_inv_freq").detach().to(torch.float64).cpu()
            out[lt] = EngineRope(inv, attention_scaling_of(module, lt), 1.0, f"ropescale: {lt} kept as shipped")
    return out


def compare_layers(ours: dict[str | None, EngineRope], theirs: dict[str | None, EngineRope], length: int) -> Verdict:
    """``compare`` per layer type: ``ours`` and ``theirs`` map each layer type to its ``EngineRope``
    (``ropescale_layer_ropes``; an engine's per-type ``rope``). ``same`` only when every type of
    ``ours`` is the same in ``theirs``; ``verdict`` names each type that differs (or that the engine
    does not compute) with its reasons. The numbers are the worst over the types: largest relative
    frequency difference (``rel_freq_diff``: that type's ``[d/2]``), magnitude and softmax-scale
    differences, largest angle difference. Raises ``InvalidInput`` for a bad length."""
    length = check_length(length, "length")
    verdicts, reasons = {}, []
    for lt, mine in ours.items():
        if lt not in theirs:
            reasons.append(f"{lt}: the engine computes no rotation for these layers")
            continue
        v = verdicts[lt] = compare(mine, theirs[lt], length)
        if not v.same:
            reasons.append(f"{lt}: {v.verdict.removeprefix('differs: ')}")
    if not verdicts:
        return Verdict(length, torch.zeros(0, dtype=torch.float64), math.inf, math.inf, math.inf, math.inf, False,
                       "differs: " + "; ".join(reasons))
    worst = max(verdicts.values(), key=lambda v: v.max_rel_freq_diff)
    same = not reasons
    return Verdict(length, worst.rel_freq_diff, worst.max_rel_freq_diff,
                   max(v.magnitude_diff for v in verdicts.values()),
                   max(v.softmax_scale_diff for v in verdicts.values()),
                   max(v.max_angle_diff for v in verdicts.values()), same,
                   ("same (per layer type: " + ", ".join(str(lt) for lt in verdicts) + ")") if same
                   else "differs: " + "; ".join(reasons))
