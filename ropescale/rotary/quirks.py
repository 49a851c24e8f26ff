"""What a model family does differently from the generic path, in one declared table.

Everything else on the model side reads the model: rotary modules are found by their ``inv_freq``
buffers (``ropescale.rotary.modules``), each layer's rotation is watched (``ropescale.rotary.probe``),
frequencies are swapped in the module's own buffers (``ropescale.rotary.frequencies``). What a family
does that this cannot see or must not touch is a row of ``QUIRKS`` — a predicate with a one-line
refusal, or an override held while a patch is on — with the families it concerns, the source it was
read from and the test that pins it; ``PROBE_CONTRACTS`` declares the rotations the probe tries.
An architecture the census finds wrong gets a row here (or a probe contract), never a branch elsewhere.

Stages (when ``ropescale.patch`` asks):

- ``unrotated``: the model has no ``inv_freq`` module: ``check(model)`` → refusal or None;
- ``modules``: its rotary modules found: ``check(model, found)`` → refusal or None;
- ``layers``: a relative-position rule, after the probe: ``check(model, layers, strategy)`` → refusal or None;
- ``frequencies``: a rotary module's buffers about to be swapped: ``apply(module, entries)`` → restore or None;
- ``site``: a frequency set patched: ``apply(model, handle, strategy, site, modules)`` → restore or None;
- ``patch``: every frequency set patched: ``apply(model, handle, strategy)`` → restore or None.

Refusals raise ``NoRotaryEmbeddingError`` (or ``InvalidInput``) with the row's message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
from torch import nn

from ropescale.errors import InvalidInput
from ropescale.rotary.modules import (
    NoRotaryEmbeddingError,
    inv_freq_name,
    layer_rope_parameters_of,
    layer_types_of,
    text_config_of,
)
from ropescale.rotary.sites import LayerRope, RotarySite
from ropescale.temperature import NATIVE

__all__ = ["PROBE_CONTRACTS", "QUIRKS", "STAGES", "ProbeContract", "Quirk", "apply_quirk_overrides", "ignores_buffers",
           "model_softmax_scale", "native_softmax_scale", "refuse"]

STAGES = ("unrotated", "modules", "layers", "frequencies", "site", "patch")


@dataclass(frozen=True)
class Quirk:
    """One row: ``name``; ``families`` it concerns; ``stage`` (``STAGES``); ``run`` (a refusal's check or an
    override's apply, by stage, see the module docstring); ``source`` (where the behaviour was read);
    ``test`` (the test that pins it, ``path::name``)."""

    name: str
    families: str
    stage: str
    run: Callable[..., Any]
    source: str
    test: str


# --- refusals --------------------------------------------------------------------------------------

def _precomputed_table(model: nn.Module) -> str | None:
    cfg = text_config_of(model, model)
    rope_config = getattr(cfg, "rotary_dim", None) or hasattr(cfg, "rotary_value")  # GPT-J, CodeGen; RoFormer
    table = next((m for m in model.modules() if type(m).__name__.endswith(("RotaryEmbedding",
                                                                            "SinusoidalPositionalEmbedding"))
                  and (m._buffers or rope_config)), None)
    if table is None or not (rope_config or type(table).__name__.endswith("RotaryEmbedding")):
        return None
    return (f"{type(model).__name__} applies RoPE from a precomputed sinusoidal table ({type(table).__name__}), "
            "not from an `inv_freq` buffer; ropescale changes RoPE through the frequencies and cannot patch this "
            "family")


def _rope_init_fn(module: nn.Module, entries: dict):
    """Phi-3.5-MoE's ``PhimoeRotaryEmbedding.forward`` calls ``self.rope_init_fn(self.config)`` at every call:
    pointed at the module's buffers meanwhile, and its config's rope type reads ``default``, so the shipped
    short/long mscale gives way to the strategy's ``attention_scaling``."""
    init = module.__dict__.get("rope_init_fn")
    if not callable(init) or list(entries) != [None]:
        return None
    module.rope_init_fn = _from_buffers(module)
    rp = getattr(getattr(module, "config", None), "rope_parameters", None)
    rope_type = rp.get("rope_type", "default") if isinstance(rp, dict) else "default"
    if rope_type != "default":
        rp["rope_type"] = "default"

    def restore() -> None:
        module.rope_init_fn = init
        if rope_type != "default":
            rp["rope_type"] = rope_type

    return restore


def _from_buffers(module: nn.Module):
    """A ``rope_init_fn`` that returns what ``module`` holds now: (``inv_freq``, ``attention_scaling``)."""
    def rope_init_fn(*args, **kwargs):
        return module.inv_freq, module.attention_scaling
    return rope_init_fn


def ignores_buffers(module: nn.Module) -> bool:
    """Whether ``module``'s output stays the same when its ``inv_freq`` buffers change: a rotary module
    that recomputes its frequencies from the config at every call cannot be patched through them
    (Phi-3.5-MoE's does, through its ``rope_init_fn``, which the ``rope_init_fn`` row points at the buffers).
    Calls the module at positions 1 and 2 with its buffers as they are and doubled; a
    module that cannot be called so (another signature) counts as following them."""
    types = layer_types_of(module)
    buf = next(iter(module._buffers[inv_freq_name(lt)] for lt in types))
    x = torch.zeros(1, 2, 1, dtype=buf.dtype if buf.is_floating_point() else torch.float32, device=buf.device)
    pos = torch.arange(1, 3, device=buf.device)[None]  # [1, 2]

    def call():
        with torch.no_grad():
            out = module(x, pos) if types == [None] else module(x, pos, types[0])
        return [t.detach().clone() for t in (out if isinstance(out, (tuple, list)) else (out,))]

    saved = {lt: module._buffers[inv_freq_name(lt)] for lt in types}
    absent = object()
    rope_type = module.__dict__.get("rope_type", absent)  # transformers' dynamic update would reset the buffers
    if rope_type is not absent:
        module.rope_type = {k: "default" for k in rope_type} if isinstance(rope_type, dict) else "default"
    init = module.__dict__.get("rope_init_fn") if types == [None] else None
    if callable(init):  # the rope_init_fn row reads it back from the buffers too
        module.rope_init_fn = _from_buffers(module)
    try:
        before = call()
        for lt, b in saved.items():
            module._buffers[inv_freq_name(lt)] = b * 2
        after = call()
    except Exception:  # noqa: BLE001 — a signature of its own: nothing to conclude
        return False
    finally:
        for lt, b in saved.items():
            module._buffers[inv_freq_name(lt)] = b
        if rope_type is not absent:
            module.rope_type = rope_type
        if callable(init):
            module.rope_init_fn = init
    return all(torch.equal(a, b) for a, b in zip(before, after))


def _deaf(model: nn.Module, found: list[tuple[str, nn.Module]]) -> str | None:
    deaf = next(((n, m) for n, m in found if ignores_buffers(m)), None)
    if deaf is None:
        return None
    return (f"{type(model).__name__}: its rotary module {deaf[0]} ({type(deaf[1]).__name__}) recomputes its "
            "frequencies from the config at every call instead of reading its inv_freq buffer, through which "
            "ropescale changes RoPE: this family cannot be patched")


def _nested(model: nn.Module, found: list[tuple[str, nn.Module]]) -> str | None:
    # layers.<i>.<part>.<sub>.…: a rotary module below an attention layer's own parts
    nested = next((n for n, _ in found if re.search(r"\.\d+\.[^.]+\.[^.]+\.", n)), None)
    if nested is None:
        return None
    return (f"{type(model).__name__}: a rotary module inside a part of an attention layer ({nested}) rotates keys "
            "the layer compresses or indexes itself (DeepSeek-V4's compressors), at positions of its own; "
            "ropescale cannot patch them consistently with the layer's queries")


def _additive_mask(model: nn.Module, layers: list[LayerRope], strategy: str) -> str | None:
    additive = next((info for info in layers if info.additive_mask), None)
    if additive is None:
        return None
    return (f"{type(model).__name__}: layer {additive.index} ({additive.name}) adds a learned per-head bias to its "
            f"attention scores through the mask (Doge's dynamic mask); {strategy}'s kernels take padding masks "
            "only and would drop it")


# --- overrides while patched -----------------------------------------------------------------------

def native_softmax_scale(rope_parameters: dict[str, Any]) -> float:
    """The factor a model's attention multiplies its softmax scale by, as its config ships it: DeepSeek's
    families (``yarn_apply_mscale``) use mscale(s, ``mscale_all_dim``)² under any scaled rope type, else 1."""
    from ropescale.strategies.by_parts import yarn_get_mscale

    if rope_parameters.get("rope_type", "default") == "default" or not rope_parameters.get("mscale_all_dim"):
        return 1.0
    return yarn_get_mscale(float(rope_parameters["factor"]), float(rope_parameters["mscale_all_dim"])) ** 2


def _applied(attn: nn.Module, head_dim: int, shipped: float) -> float:
    """The shipped softmax factor ``shipped`` if ``attn`` multiplies it into its ``scaling`` (read from the
    module, not assumed from the config: DeepSeek's families do, Ministral 3 ships ``mscale_all_dim`` and
    does not), else 1."""
    return shipped if abs(attn.scaling * head_dim ** 0.5 - shipped) <= 1e-6 * shipped else 1.0


def model_softmax_scale(model: nn.Module) -> float:
    """The factor the model's attention multiplies its softmax scale by, as loaded: DeepSeek's mscale(s,
    ``mscale_all_dim``)² where its attention applies it (read from the first attention module with a float
    ``scaling`` and a ``qk_head_dim`` or ``head_dim``), else 1."""
    rp = getattr(text_config_of(model, model), "rope_parameters", None) or {}
    sets = [v for v in rp.values() if isinstance(v, dict)] or [rp]
    shipped = max(native_softmax_scale(r) for r in sets)
    if shipped == 1.0:
        return 1.0
    for module in model.modules():
        head_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
        if isinstance(getattr(module, "scaling", None), float) and isinstance(head_dim, int):
            return _applied(module, head_dim, shipped)
    return 1.0


def _mscale_softmax(model: nn.Module, handle, strat, site: RotarySite, modules: dict[str, nn.Module]):
    """Attention's softmax scale of the layers rotating with ``site``: the model's own factor (DeepSeek's
    mscale²) replaced by the strategy's (``Strategy.softmax_scale``; ``keeps_model`` ones keep the model's), so
    ``vanilla`` is the unscaled model and ``yarn`` with ``mscale_all_dim`` equals transformers' own."""
    shipped = native_softmax_scale(layer_rope_parameters_of(model, site))
    if strat.keeps_model or shipped == strat.softmax_scale(handle.params) == 1.0:
        return None
    if handle.layers is None:
        if shipped == strat.softmax_scale(handle.params):
            return None
        raise InvalidInput(f"{strat.name} changes the attention softmax scale this model's config sets "
                           f"(mscale_all_dim), but its attention layers cannot be observed to rescale them")
    saved = []
    for info in handle.layers:
        if info.kind != "rope" or info.site != site:
            continue
        attn = modules.get(info.name)
        if attn is None or not isinstance(getattr(attn, "scaling", None), float) or not info.head_dim:
            continue
        native = _applied(attn, info.head_dim, shipped)
        ours = strat.softmax_scale(handle.params)
        if ours != native:
            saved.append((attn, attn.scaling))
            attn.scaling = attn.scaling / native * ours

    def restore() -> None:
        for attn, value in saved:
            attn.scaling = value

    return restore


def _shipped_beta(model: nn.Module, handle, strat):
    """A strategy that does not keep the model (``native`` does) replaces the model's shipped scaling, including
    the query temperature its attention reads from the config at every forward (Mistral's ``llama_4_scaling_beta``):
    set to 0 while patched, so ``vanilla`` is the unscaled model — unless the patch keeps the model's own
    temperature (``temperature="native"``), or adds a rule of its own instead (``temperature="beta:beta=…"``)."""
    if strat.keeps_model or handle.options.get("temperature") == NATIVE:
        return None
    rp = getattr(text_config_of(model, model), "rope_parameters", None)
    saved = []
    for params in ([rp] if isinstance(rp, dict) else []) + [v for v in (rp or {}).values() if isinstance(v, dict)]:
        if params.get("llama_4_scaling_beta"):
            saved.append((params, params["llama_4_scaling_beta"]))
            params["llama_4_scaling_beta"] = 0.0
    if not saved:
        return None

    def restore() -> None:
        for params, beta in saved:
            params["llama_4_scaling_beta"] = beta

    return restore


_TF = "transformers 5.x models/"
QUIRKS: tuple[Quirk, ...] = (
    Quirk("precomputed_table", "GPT-J, CodeGen, RoFormer, GPT-NeoX-Japanese", "unrotated", _precomputed_table,
          _TF + "gptj/modeling_gptj.py (create_sinusoidal_positions), roformer/modeling_roformer.py",
          "tests/test_census.py::test_census[gptj-vanilla]"),
    Quirk("rope_init_fn", "Phi-3.5-MoE", "frequencies", _rope_init_fn,
          _TF + "phimoe/modeling_phimoe.py (PhimoeRotaryEmbedding.forward calls rope_init_fn)",
          "tests/test_census.py::test_census[phimoe-yarn]"),
    Quirk("ignores_buffers", "any rotary module that recomputes its frequencies at every call", "modules", _deaf,
          "read from the module: its output at positions 1, 2 with its buffers doubled",
          "tests/rotary/test_quirks.py::test_a_module_that_ignores_its_buffers_is_refused"),
    Quirk("nested_rotary", "DeepSeek-V4 (its compressors' rotary modules)", "modules", _nested,
          _TF + "deepseek_v4/modeling_deepseek_v4.py (compressors call the module with positions of their own)",
          "tests/test_census.py::test_census[deepseek_v4-vanilla]"),
    Quirk("additive_mask", "Doge (dynamic mask)", "layers", _additive_mask,
          _TF + "doge/modeling_doge.py (prepare_dynamic_mask adds a per-head bias to the mask)",
          "tests/test_census.py::test_census[doge-rerope]"),
    Quirk("mscale_softmax", "DeepSeek-V2/V3, Kimi K2, GLM-4.5 MoE (MLA with YaRN mscale_all_dim)", "site",
          _mscale_softmax,
          _TF + "deepseek_v3/modeling_deepseek_v3.py (self.scaling *= mscale² under rope_scaling)",
          "tests/test_census.py::test_census[deepseek_v3-native_shipped]"),
    Quirk("shipped_beta", "Ministral 3, Mistral 3 (llama_4_scaling_beta)", "patch", _shipped_beta,
          _TF + "ministral3/modeling_ministral3.py (get_llama_4_attn_scale reads the config at every forward)",
          "tests/test_temperature.py::test_native_temperature_keeps_the_models_own"),
)


def _rows(stage: str) -> list[Quirk]:
    return [q for q in QUIRKS if q.stage == stage]


def refuse(stage: str, *args: Any, error: type[Exception] = NoRotaryEmbeddingError) -> None:
    """Raise ``error`` with the message of the first row of refusal stage ``stage`` whose check fires on
    ``args`` (see the module docstring); nothing when none does."""
    for quirk in _rows(stage):
        message = quirk.run(*args)
        if message:
            raise error(message)


def apply_quirk_overrides(stage: str, *args: Any) -> list[Callable[[], None]]:
    """Apply every override row of ``stage`` to ``args``; their restore callables, in application order."""
    return [r for quirk in _rows(stage) if (r := quirk.run(*args)) is not None]


# --- the rotations the probe tries ----------------------------------------------------------------

@dataclass(frozen=True)
class ProbeContract:
    """One way an attention layer can rotate q and k with a frequency set of d channels: the channels
    ``start`` (``"head"``: [0, d); ``"tail"``: the head's last d), ``interleaved`` pairs (2i, 2i+1) instead
    of (i, i + d/2), ``sign`` ±1 of the angle; ``families`` that use it, ``source``."""

    start: str
    interleaved: bool
    sign: int
    families: str
    source: str

    def start_channel(self, head_dim: int, d: int) -> int:
        """The first rotated channel of a head under this contract.

        Args:
            head_dim: the head's channels.
            d: the rotated channels.

        Returns:
            0 (``head``: the rotated channels first) or ``head_dim - d`` (``tail``: after the others).
        """
        return 0 if self.start == "head" else head_dim - d


_STARTS = {"head": "the Llama lineage", "tail": "DeepSeek's MLA (rotary channels after the nope ones)"}
_PAIRS = {False: "rotate_half (the Llama lineage)", True: "interleaved pairs (GLM, Ernie 4.5, Cohere)"}
_SIGNS = {1: "the Llama lineage", -1: "NanoChat's mirrored rotate_half"}
PROBE_CONTRACTS: tuple[ProbeContract, ...] = tuple(
    ProbeContract(start, interleaved, sign, f"{_STARTS[start]}; {_PAIRS[interleaved]}; sign: {_SIGNS[sign]}",
                  _TF + "{llama,deepseek_v3,glm,nanochat}/modeling_*.py (apply_rotary_pos_emb)")
    for start, interleaved, sign in product(_STARTS, _PAIRS, _SIGNS))
"""In the order the probe tries them (the first that reproduces both q and k wins)."""
