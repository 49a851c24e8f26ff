"""Step one of every engine export: a patch → the transformers ``rope_parameters`` it serves.

The strategy's own export hook (``register(export=...)``, via
``ropescale.models.native_rope_parameters``) gives the transformers rope type; each engine module
(``ropescale.serving.engines``) then translates that by rope type. Here: what no engine config
expresses is refused with one line naming the engine, and dynamic NTK — which the static engines
(vLLM, llama.cpp) serve — is frozen at a length the user names: the raised base
b' = b·(s·F/T − (s − 1))^(d/(d−2)) that ropescale's ``dynamic_ntk`` uses at F (vanilla for F ≤ T),
written as ``rope_type: default``.

Per-layer-type models (Gemma 3: ``sliding_attention``/``full_attention``, each with its own rope
parameters): an engine that can say so (``per_layer_type=True``) gets every layer type's rope
parameters — the patched types translated as above, each from its own context, the others exactly
as shipped (``ServedRope.layer_types``) — and decides itself which of them its config expresses;
any other engine refuses the patch in one line.

Notation: b = ``rope_theta``, d = rotary dim, T = training window
(``original_max_position_embeddings``), s = ``factor``, L = served length, F = freeze length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ropescale.errors import InvalidInput
from ropescale.models import native_rope_parameters
from ropescale.patching import PatchHandle
from ropescale.rope_config import rope_config_of, text_config
from ropescale.serving.rope import ExportRefused, check_length, served_temperatures
from ropescale.temperature import Temperature

__all__ = ["ServedRope", "check_deepseek_yarn", "check_freeze", "served_rope_parameters", "static_equivalent"]


@dataclass
class ServedRope:
    """The transformers ``rope_parameters`` an engine must reproduce, with their context.

    rope_parameters: ``rope_type`` and its keys (``rope_theta`` included); context: ``dim``,
    ``rope_theta``, ``original_max_position_embeddings`` of the patched layers (the first patched
    type's for a per-layer-type model); serve_length: L; frozen_at: F for a frozen dynamic strategy,
    else None; notes: what the export had to decide.
    layer_types: for a per-layer-type model, every layer type of its config → the rope parameters
    that type serves (patched: translated; kept: as shipped), in the config's order; None for one set.
    layer_contexts: the same types → their ``dim``, ``rope_theta``, ``original_max_position_embeddings``;
    patched_types: the layer types the patch changed; nope_types: the config's layer types whose rope
    parameters are None (NoPE: no rotation; not in ``layer_types``), written back as None (``keyed``).
    """

    rope_parameters: dict[str, Any]
    context: dict[str, Any]
    serve_length: int
    strategy: str
    frozen_at: int | None = None
    notes: list[str] = field(default_factory=list)
    layer_types: dict[str, dict[str, Any]] | None = None
    layer_contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    patched_types: list[str] = field(default_factory=list)
    temperature: Temperature | None = None  # the query temperature of the RoPE layers, of a kind the engine reads
    nope_types: list[str] = field(default_factory=list)

    def keyed(self, per_type: dict[str, Any]) -> dict[str, Any]:
        """``per_type`` (rope parameters by layer type, as an engine writes them) with the NoPE layer types back
        as None, as the config ships them: a loader indexes the rope parameters of every layer type."""
        return {**per_type, **dict.fromkeys(self.nope_types)}


def check_deepseek_yarn(engine: str, version: str, rp: dict[str, Any]) -> None:
    """``ExportRefused`` (one line) for what an engine's DeepSeek attention (vLLM's and SGLang's
    ``deepseek_v2.py``) cannot serve of the scaled rope parameters ``rp``: it serves every scaled rope type as
    DeepSeek's YaRN, whose ramp is always rounded — so another type, or ``truncate: false``."""
    if rp["rope_type"] != "yarn":
        raise ExportRefused(f"{engine}: {engine} {version}'s DeepSeek attention (deepseek_v2.py) serves every scaled "
                            f"rope type as DeepSeek's YaRN, so {rp['rope_type']!r} cannot be expressed; patch yarn, "
                            "or a raised base (ntk)")
    if rp.get("truncate") is False:
        raise ExportRefused(f"{engine}: its DeepSeek YaRN always rounds the ramp's correction dims (truncate: true); "
                            "an unrounded ramp (truncate: false) cannot be expressed")


def served_rope_parameters(handle: PatchHandle, engine: str, serve_length: int, *,
                           freeze_dynamic_at: int | None = None, freeze_default: bool = True,
                           per_layer_type: bool = False, temperatures: tuple[str, ...] = ()) -> ServedRope:
    """The rope parameters ``engine`` must serve for ``handle`` at ``serve_length`` [tokens].

    ``freeze_dynamic_at``: F for dynamic NTK (default: L when ``freeze_default``, else refused).
    ``per_layer_type``: the engine reads ``ServedRope.layer_types`` (every layer type's parameters,
    the kept ones as shipped) for a per-layer-type model; otherwise such a patch is refused.
    ``temperatures``: the query-temperature kinds the engine's config expresses for this model (``beta``:
    vLLM's and llama.cpp's Mistral models); one of them is ``ServedRope.temperature``, any other refused.
    Raises ``ExportRefused`` ("<engine>: ...") for relative-position rules (ReRoPE, Leaky ReRoPE,
    SelfExtend, DCA, STRING …), log-n, ``dynamic_block`` ≠ 1, per-layer-type patches (without
    ``per_layer_type``), strategies without a transformers export hook, dynamic strategies other
    than ``dynamic_ntk``, and a model's own dynamic rope kept as it is (``native`` on a ``dynamic``
    config, or a kept layer type shipped dynamic); ``InvalidInput`` for bad lengths and for
    ``freeze_dynamic_at`` with any strategy but ``dynamic_ntk`` (``check_freeze``).
    """
    serve_length = check_length(serve_length)
    freeze_dynamic_at = check_freeze(handle, freeze_dynamic_at)
    strat = handle.strategy_obj
    name = strat.name
    if strat.kind != "frequency":
        raise ExportRefused(f"{engine}: {name} is a relative-position rule applied inside attention; {engine} has no "
                            "setting for it (serve it with ropescale.load_model)")
    temps = served_temperatures(handle)
    if len(temps) > 1 or any(t.kind not in temperatures for t in temps):
        what = " × ".join(t.spec() for t in temps)
        raise ExportRefused(f"{engine}: query temperature ({what}) has no {engine} setting for this model; export "
                            "without it" + (" (a strategy other than native removes the model's own)"
                                            if any(t is getattr(handle, "own_temperature", {}).get(True)
                                                   for t in temps) else ""))
    if handle.options.get("dynamic_block", 1) != 1:
        raise ExportRefused(f"{engine}: dynamic_block={handle.options['dynamic_block']} has no {engine} setting")
    if handle.layer_types != [None] and not per_layer_type:
        raise ExportRefused(f"{engine}: per-layer-type rotary patches ({handle.layer_types}) are not exported by this "
                            "engine; only models with one set of rope parameters")
    if strat.export is None:
        raise ExportRefused(f"{engine}: {name} has no transformers rope type to translate (no export hook), so "
                            f"{engine} cannot express it")
    if handle.layer_types == [None]:
        ctx = dict(handle.contexts.get(None, handle.context))
        rp, frozen, notes = _served_type(handle, engine, serve_length, freeze_dynamic_at, freeze_default, None, ctx)
        return ServedRope(rp, ctx, serve_length, name, frozen, notes, temperature=temps[0] if temps else None)
    served = _served_layer_types(handle, engine, serve_length, freeze_dynamic_at, freeze_default)
    served.temperature = temps[0] if temps else None
    return served


def _served_layer_types(handle: PatchHandle, engine: str, serve_length: int, freeze_dynamic_at: int | None,
                        freeze_default: bool) -> ServedRope:
    """``served_rope_parameters`` of a per-layer-type model: each patched type translated from its own
    context (``_served_type``), each other type of the config as shipped."""
    text = text_config(handle.model.config)
    shipped = text.rope_parameters
    layer_types, contexts, notes, frozen = {}, {}, [], None
    nope = [lt for lt, base in shipped.items() if base is None]  # NoPE layer types: nothing to serve
    for lt, base in shipped.items():
        if not isinstance(base, dict):
            continue
        if lt in handle.layer_types:
            contexts[lt] = dict(handle.contexts[lt])
            rp, frozen, more = _served_type(handle, engine, serve_length, freeze_dynamic_at, freeze_default, lt,
                                            contexts[lt])
            notes += [f"{lt}: {n}" for n in more]
        else:
            contexts[lt] = rope_config_of(text, lt).context()
            rp = dict(base)
            if "dynamic" in str(rp.get("rope_type")):
                raise ExportRefused(f"{engine}: the {lt} layers keep the model's own rope type {rp['rope_type']!r}, "
                                    f"which recomputes its base from the sequence length; {engine} serves one static "
                                    f"rotation (patch {lt} too, with layer_types)")
        layer_types[lt] = rp
    first = handle.layer_types[0]
    kept = [lt for lt in layer_types if lt not in handle.layer_types]
    if kept:
        notes.append(f"{', '.join(kept)}: kept as shipped (not patched)")
    if nope:
        notes.append(f"{', '.join(nope)}: NoPE (rope parameters None), no rotation to serve")
    return ServedRope(layer_types[first], contexts[first], serve_length, handle.strategy_obj.name, frozen, notes,
                      layer_types, contexts, list(handle.layer_types), nope_types=nope)


def _served_type(handle: PatchHandle, engine: str, serve_length: int, freeze_dynamic_at: int | None,
                 freeze_default: bool, lt: str | None, ctx: dict[str, Any]
                 ) -> tuple[dict[str, Any], int | None, list[str]]:
    """``(rope_parameters, F or None, notes)`` one layer type ``lt`` (None: the one set) serves, from
    its context ``ctx``; refusals as ``served_rope_parameters``'."""
    strat = handle.strategy_obj
    name = strat.name
    text = text_config(handle.model.config)
    base = dict(text.rope_parameters if lt is None else text.rope_parameters[lt])
    # a dynamic strategy is frozen below: the training window as max_position_embeddings, the only value
    # the `dynamic` hook accepts; a static one gets the config's (what transformers derives a missing factor from)
    mpe = ctx["original_max_position_embeddings"] if strat.dynamic else getattr(text, "max_position_embeddings", None)
    rp = native_rope_parameters(handle, base, mpe, lt, temperature_apart=True)  # vetted: served_temperatures
    if rp is None:
        raise ExportRefused(f"{engine}: {name} with these parameters has no transformers rope type to translate")
    if not strat.dynamic and "dynamic" in str(rp.get("rope_type")):  # the model's own dynamic rope, kept
        raise ExportRefused(f"{engine}: the model's own rope type {rp['rope_type']!r} recomputes its base from the "
                            f"sequence length and {engine} serves one static rotation; patch dynamic_ntk:factor="
                            f"{rp.get('factor', 1.0):g} instead, which can be frozen at a length (--freeze-dynamic-at)")
    notes: list[str] = []
    if not strat.dynamic or strat.served == "sets":  # LongRoPE: two static sets, each engine picks one
        return rp, None, notes
    if strat.served != "freeze":
        raise ExportRefused(f"{engine}: {name} recomputes its frequencies from the sequence length; {engine} "
                            "serves one static rotation and only dynamic_ntk can be frozen")
    if freeze_dynamic_at is None and not freeze_default:
        raise ExportRefused(f"{engine}: dynamic NTK recomputes its base from the sequence length and {engine} "
                            "has no dynamic rope (it would run plain RoPE); name a length to freeze it at "
                            "(--freeze-dynamic-at)")
    at = freeze_dynamic_at or serve_length
    notes.append(f"dynamic NTK frozen at {at} tokens: every sequence is served with the base ropescale "
                 f"uses at {at} (ropescale's own dynamic rule is vanilla up to "
                 f"{ctx['original_max_position_embeddings']} and rescales with the length)")
    return _frozen_dynamic(handle, rp, ctx, at), at, notes


def _frozen_dynamic(handle: PatchHandle, base: dict[str, Any], ctx: dict[str, Any], at: int) -> dict[str, Any]:
    """The rope parameters of the strategy's static form at F = ``at`` (its ``freeze`` hook), written by that
    static strategy's own exporter in the layer's context ``ctx``."""
    t = ctx["original_max_position_embeddings"]
    static, params = handle.strategy_obj.frozen(handle.params, at=at, train_length=t)
    written = static.export(params, dict(ctx), dict(base), None) if static.export is not None else None
    if written is None:
        raise ExportRefused(f"{handle.strategy_obj.label} frozen at {at} tokens is {static.name}, which transformers "
                            "rope parameters cannot express")
    return {**{k: v for k, v in base.items() if k not in ("rope_type", "factor")}, **written}


def check_freeze(handle: PatchHandle, freeze_dynamic_at: int | None) -> int | None:
    """``freeze_dynamic_at`` checked: None, or a length F [tokens] (``check_length``) for a
    ``dynamic_ntk`` patch. ``InvalidInput`` (one line) for F with any other strategy — static
    ones do not depend on the length, LongRoPE picks its factor set from the served length and
    the other dynamic rules have no static form — instead of ignoring it."""
    if freeze_dynamic_at is None:
        return None
    at = check_length(freeze_dynamic_at, "freeze_dynamic_at")
    strat = handle.strategy_obj
    if strat.served != "freeze":
        why = (f"{strat.name} is static: its rotation does not depend on the length" if not strat.dynamic else
               f"{strat.name} picks its short or long factors from the served length" if strat.served == "sets" else
               f"{strat.name} has no static form to freeze")
        raise InvalidInput(f"freeze_dynamic_at={at} (--freeze-dynamic-at) applies to dynamic_ntk only; {why}; "
                           "leave it out")
    return at


def static_equivalent(handle: PatchHandle, at: int) -> str:
    """The static strategy spec that rotates as the dynamic patch ``handle`` does at sequence length F = ``at``
    (the strategy's ``freeze`` hook: ``vanilla`` for dynamic NTK at F ≤ T, else ``ntk:factor=s'`` with
    s' = s·F/T − (s − 1))."""
    t = handle.contexts.get(None, handle.context)["original_max_position_embeddings"]
    static, params = handle.strategy_obj.frozen(handle.params, at=at, train_length=t)
    return static.name + "".join(f"{':' if i == 0 else ','}{k}={v!r}" for i, (k, v) in enumerate(params.items()))
