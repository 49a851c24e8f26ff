"""What each attention layer does with positions, read from the model itself.

Which layers rotate q and k, with which of the model's frequency sets, over which channels, in
which pairing and with which sign, is not written anywhere a patcher can read: NoPE layers
(Llama 4, SmolLM3, Cohere 2's global layers), rotary channels at the end of the head (DeepSeek's
MLA), interleaving decided in attention from halves-layout cos/sin (GLM, Ernie 4.5), a mirrored
``rotate_half`` (NanoChat) all look the same from the rotary module. So ``probe_layers`` *watches*
each layer: one forward of tokens at positions 0..p per batch row, through a recording attention
function, once as the model is and once with every rotary module's frequencies set to zero (RoPE
becomes the identity, times the module's own attention factor), each layer's input held to the first
forward's by a pre-hook, so the difference between the two queries (keys) a layer hands to attention
for the token at p is exactly its rotation. (The tokens before p give a sparse-attention indexer that
anchors key blocks to slots — MiniMax M3 — the keys it expects; only the last token is compared.) Each
candidate contract — a frequency set of the model, the channels [start, start + d), halves or
interleaved pairs, sign ±1 — is replayed on the identity-run q and k and kept when it reproduces
the model's (checked at two positions). A layer whose q and k do not change is a layer without
RoPE.

Shapes: b batch, h heads, s tokens, h_d q/k head dim, h_v value head dim, d rotary channels.
Rotation (pair (x1, x2) of frequency θ at position p, sign σ): x1 cos(σpθ) − x2 sin(σpθ),
x2 cos(σpθ) + x1 sin(σpθ) — Su et al. 2021 (arXiv:2104.09864); transformers' ``rotate_half``
(σ = +1, halves), GLM's (interleaved), NanoChat's (σ = −1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ropescale.rotary.modules import inv_freq_name
from ropescale.rotary.quirks import PROBE_CONTRACTS
from ropescale.rotary.sites import LayerRope, RotarySite

__all__ = ["layers_without_attention", "probe_layers", "rotate_pairs"]

PROBE = "ropescale_probe"
PROBE_LEAN = "ropescale_probe_lean"  # the same recorder with padding-only masks
_PROBE_ATTR = "_ropescale_probe"
_POSITIONS = (3, 7)  # the contract must hold at both


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor, *, start: int, interleaved: bool,
                 scale: float = 1.0) -> torch.Tensor:
    """Rotate channels [start, start + d) of ``x`` ``[..., s, h_d]`` by ``angles`` ``[..., s, d/2]``
    (radians, σ·p·θ per pair), in float32 (float64 for float64 ``x``: cos and sin of the angles as given,
    the products in x's precision, as the models do), times ``scale``; other channels pass through
    unchanged. Returns x's dtype."""
    d = 2 * angles.shape[-1]
    rot = x[..., start : start + d].to(torch.promote_types(x.dtype, torch.float32))
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    cos, sin = (angles.cos() * scale).to(rot.dtype), (angles.sin() * scale).to(rot.dtype)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return torch.cat((x[..., :start], out.to(x.dtype), x[..., start + d :]), -1)


@dataclass
class _Recorder:
    """Per-probe state on every submodule: the attention calls seen (module → q, k, v, kwargs keys)."""

    base: str
    calls: dict = field(default_factory=dict)
    order: list = field(default_factory=list)


def _record(module, query, key, value, attention_mask, **kwargs):
    from ropescale.attention.interface import base_attention  # the model's own implementation runs the forward

    rec = getattr(module, _PROBE_ATTR)
    if module not in rec.calls:
        additive = (attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dim() == 4
                    and attention_mask.shape[1] > 1)  # [b, n_h, s_q, s_k]: a bias per head, not a padding mask
        # the last token's q and k (at the probed position; the tokens before it only give the model the keys an
        # indexer anchored to slots needs: MiniMax M3 selects key blocks by position)
        rec.calls[module] = (query[..., -1:, :].detach().clone(), key[..., -1:, :].detach().clone(), value.shape[-1],
                             kwargs.get("position_ids") is not None,
                             any(k.endswith("indices") and v is not None for k, v in kwargs.items()), additive)
        rec.order.append(module)
    return base_attention(module, rec.base)(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ropescale.attention.interface import padding_only_mask

    AttentionInterface.register(PROBE, _record)
    AttentionInterface.register(PROBE_LEAN, _record)
    mask = AttentionMaskInterface._global_mapping.get("sdpa")
    if mask is not None:
        AttentionMaskInterface.register(PROBE, mask)
    AttentionMaskInterface.register(PROBE_LEAN, padding_only_mask)  # the relative-position rules' masks: padding only


@contextlib.contextmanager
def _static_rope_types(modules: dict[str, nn.Module], sites: list[RotarySite]):
    """Each rotary module's ``rope_type`` reads ``default`` meanwhile: transformers' ``dynamic_rope_update``
    would otherwise replace the buffers the probe sets (a dynamic model resets them for short inputs)."""
    saved = []
    for name in dict.fromkeys(site.module_name for site in sites):
        module = modules[name]
        if "rope_type" in module.__dict__:
            rt = module.__dict__["rope_type"]
            saved.append((module, rt))
            module.rope_type = {k: "default" for k in rt} if isinstance(rt, dict) else "default"
    try:
        yield
    finally:
        for module, rt in saved:
            module.rope_type = rt


@contextlib.contextmanager
def _frequencies_zeroed(modules: dict[str, nn.Module], sites: list[RotarySite]):
    """Every site's ``inv_freq`` set to zeros (cos = attention factor, sin = 0: RoPE is the identity
    up to the module's own scale), restored after."""
    saved = []
    for site in sites:
        module = modules[site.module_name]
        name = inv_freq_name(site.layer_type)
        buf = module._buffers[name]
        saved.append((module, name, buf))
        module._buffers[name] = torch.zeros_like(buf)
    try:
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf


def _forward(model, recorder: _Recorder, position: int, inputs: dict | None = None,
             capture: dict | None = None) -> dict:
    """One probe forward at ``position``; ``capture``: filled with each watched layer's input hidden
    states; ``inputs``: each watched layer's input replaced by these (the same input in two forwards).
    Returns {attention module: (q, k, value head dim, passes position_ids)}."""
    recorder.calls, recorder.order = {}, []
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    vocab = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                    "vocab_size", 8) or 8
    ids = torch.tensor([[1 % vocab], [2 % vocab]], device=device).expand(2, position + 1)  # [b=2, s=p+1]
    pos = torch.arange(position + 1, device=device).expand(2, -1)  # the probed token last, at p
    hooks = []
    for module in (inputs or capture or {}):

        def pre(mod, args, kwargs):
            if "hidden_states" in kwargs:
                if capture is not None:
                    capture[mod] = kwargs["hidden_states"].detach().clone()
                if inputs is not None:
                    kwargs["hidden_states"] = inputs[mod]
            elif args:
                if capture is not None:
                    capture[mod] = args[0].detach().clone()
                if inputs is not None:
                    args = (inputs[mod], *args[1:])
            return args, kwargs

        hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return dict(recorder.calls)


def _site_tables(model, modules, sites) -> dict[RotarySite, torch.Tensor]:
    out = {}
    for site in sites:
        name = inv_freq_name(site.layer_type)
        out[site] = modules[site.module_name]._buffers[name].detach().float()
    return out


def _match(q0: torch.Tensor, q1: torch.Tensor, angles_of, head_dim: int, tables) -> tuple | None:
    """The first contract (site, start, d, interleaved, sign) — a frequency set of the model and a rotation of
    ``ropescale.rotary.quirks.PROBE_CONTRACTS`` — that turns q0 into q1 at every probed position
    (``angles_of(inv_freq, sign, p)`` → ``[d/2]`` angles)."""
    for site, inv_freq in tables.items():
        d = 2 * inv_freq.numel()
        if d > head_dim:
            continue
        for c in PROBE_CONTRACTS:
            start = c.start_channel(head_dim, d)
            if c.start == "tail" and start == 0:  # d = head_dim: the head contracts were these, already tried
                continue
            if all(_close(rotate_pairs(q0[p], angles_of(inv_freq, c.sign, p), start=start,
                                       interleaved=c.interleaved), q1[p]) for p in _POSITIONS):
                return site, start, d, c.interleaved, c.sign
    return None


# many models rotate in float32 whatever their dtype: float64 models get float32's tolerance
_REL_TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a ≈ b relative to b's largest entry, at the rounding of b's dtype."""
    tol = _REL_TOL.get(b.dtype, 1e-4) * max(float(b.abs().max()), 1e-6)
    return bool((a.float() - b.float()).abs().max() <= tol)


def _switch_back(model, name: str | None) -> None:
    """Back to the model's implementation: through the config setter for a flash-named one (whose
    ``set_attn_implementation`` would look for a kernel of that name), else the public setter."""
    from transformers.utils.generic import is_flash_attention_requested

    if name and is_flash_attention_requested(requested_attention_implementation=name):
        model.config._attn_implementation = name
    else:
        model.set_attn_implementation(name)


_PROBED = "_ropescale_probed"  # on the model: (what the probe depends on, its result)


def probe_layers(model: nn.Module, modules: dict[str, nn.Module], sites: list[RotarySite]) -> list[LayerRope] | None:
    """What each decoder layer does with positions, probed once per model: the result is kept on the model
    with what it depends on — the attention implementation, the module names, the frequency sets and their
    sizes — and probed again when any of them changes (a sweep or a search patches one model hundreds of
    times; the probe costs ~6 forwards).

    Args:
        model: the loaded model.
        modules: its rotary modules by name (``find_rotary_modules``).
        sites: the frequency sets those modules hold (``RotarySite``: a module and a layer type).

    Returns:
        One ``LayerRope`` per decoder layer, or None when the model's attention could not be observed.
    """
    key = (getattr(model.config, "_attn_implementation", None), tuple(modules),
           tuple((site, tuple(modules[site.module_name]._buffers[
               inv_freq_name(site.layer_type)].shape)) for site in sites))
    kept = model.__dict__.get(_PROBED)
    if kept is not None and kept[0] == key:
        return kept[1]
    layers = _probe(model, modules, sites)
    model.__dict__[_PROBED] = (key, layers)
    return layers


def _probe(model: nn.Module, modules: dict[str, nn.Module], sites: list[RotarySite]) -> list[LayerRope] | None:
    """Each attention layer's ``LayerRope``, in call order, or None when the model's attention does
    not go through transformers' ``AttentionInterface`` (no layer reached the recording function) or
    the probe forward itself fails (the reason is then unknown: callers refuse what needs it).

    ``modules``: the model's named modules; ``sites``: every frequency set of the model's rotary
    modules. Runs 1 + 2·2 forwards of p + 1 ≤ 8 tokens per batch row, each layer's input held fixed between the
    forwards it is compared across (forward pre-hooks); the model is left as it was. A layer is without RoPE
    when its q and k do not move with the frequencies (``patch`` first checks that every rotary module's
    output follows its buffers: ``ropescale.rotary.quirks.ignores_buffers``).
    """
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():  # attention written in the modeling file (Falcon): nothing to watch
        return None
    _register()
    current = model.config._attn_implementation
    base = current if current and current != PROBE else "sdpa"
    recorder = _Recorder(base)
    tagged = list(model.modules())
    training = [m.training for m in tagged]  # the probe runs in eval mode: dropout would move q and k
    for m in tagged:
        setattr(m, _PROBE_ATTR, recorder)
        m.training = False
    try:
        watched, runs, lean_fails = _probe_forwards(model, recorder, modules, sites, current)
    except Exception:  # noqa: BLE001 — a model the probe cannot drive: nothing is known about its layers
        return None
    finally:
        for m, was in zip(tagged, training):
            m.training = was
            if _PROBE_ATTR in m.__dict__:
                delattr(m, _PROBE_ATTR)
    order = list(watched)  # the attention layers in call order, from the first forward
    if not order or any(set(r) != set(order) for r in runs.values()):
        return None
    names = {m: n for n, m in model.named_modules()}
    tables = _site_tables(model, modules, sites)
    return [_layer_rope(i, module, names.get(module, "?"), runs, lean_fails, tables) for i, module in enumerate(order)]


def _probe_forwards(model: nn.Module, recorder: _Recorder, modules: dict[str, nn.Module], sites: list[RotarySite],
                    current: str | None) -> tuple[dict, dict, bool]:
    """``probe_layers``' forwards under the recording attention: (the attention layers in call
    order, as dict keys; per ("model" | "id", position) what each layer recorded, with the model's
    frequencies and with them zeroed (RoPE as the identity) on the same inputs; whether the layers
    fail on padding-only masks). The attention implementation is switched back to ``current``;
    whatever a forward raises propagates."""
    runs = {}
    model.set_attn_implementation(PROBE)
    try:
        with _static_rope_types(modules, sites):
            watched = dict.fromkeys(_forward(model, recorder, _POSITIONS[0]))  # the attention layers
            fed = {}
            for p in _POSITIONS:  # each layer's q and k from the same input: the model's, then RoPE as identity
                fed[p] = dict(watched)
                runs[("model", p)] = _forward(model, recorder, p, capture=fed[p])
                with _frequencies_zeroed(modules, sites):
                    runs[("id", p)] = _forward(model, recorder, p, inputs=fed[p])
            model.set_attn_implementation(PROBE_LEAN)  # can its layers run on padding-only masks?
            try:
                _forward(model, recorder, _POSITIONS[0])
                lean_fails = False
            except Exception:  # noqa: BLE001 — an indexer that reads the full mask (Qwen4's QSA)
                lean_fails = True
    finally:
        _switch_back(model, current)
    return watched, runs, lean_fails


def _angles(inv_freq, sign, p):
    return (torch.tensor(float(p)) * inv_freq) * sign  # [d/2], float32 as the rotary modules compute


def _layer_rope(i: int, module: nn.Module, name: str, runs: dict, lean_fails: bool, tables: dict) -> LayerRope:
    """One attention layer's ``LayerRope`` from ``probe_layers``' runs: no RoPE when its q and k do
    not move with the frequencies, else the rotary site, channels and layout both q and k match
    (``_match``), or "unknown"."""
    q0 = {p: runs[("id", p)][module][0] for p in _POSITIONS}
    q1 = {p: runs[("model", p)][module][0] for p in _POSITIONS}
    k0 = {p: runs[("id", p)][module][1] for p in _POSITIONS}
    k1 = {p: runs[("model", p)][module][1] for p in _POSITIONS}
    _, _, v_dim, passes, indexed, additive = runs[("model", _POSITIONS[0])][module]
    flags = {"full_mask": indexed or lean_fails, "additive_mask": additive}
    head_dim = q0[_POSITIONS[0]].shape[-1]
    index = getattr(module, "layer_idx", None)
    index = i if not isinstance(index, int) else index
    if all(torch.equal(q0[p], q1[p]) and torch.equal(k0[p], k1[p]) for p in _POSITIONS):
        return LayerRope(index, name, "none", head_dim=head_dim, v_head_dim=v_dim, passes_position_ids=passes,
                         **flags)
    found = _match(q0, q1, _angles, head_dim, tables)
    if found is not None and _match(k0, k1, _angles, head_dim, {found[0]: tables[found[0]]}) is None:
        found = None
    if found is None:
        return LayerRope(index, name, "unknown", head_dim=head_dim, v_head_dim=v_dim, passes_position_ids=passes,
                         **flags)
    site, start, d, interleaved, sign = found
    return LayerRope(index, name, "rope", site, start, d, interleaved, sign, head_dim, v_dim, passes, **flags)


def _stack_slot(name: str, modules: dict[str, nn.Module]) -> tuple[str, int] | None:
    """(the qualified name of the outermost ``nn.ModuleList`` the module ``name`` sits in, the index
    of its entry there), or None outside any list."""
    parts = name.split(".")
    for k, part in enumerate(parts):
        parent = ".".join(parts[:k])
        if part.isdigit() and isinstance(modules.get(parent), nn.ModuleList):
            return parent, int(part)
    return None


def layers_without_attention(model: nn.Module, layers: list[LayerRope]) -> list[tuple[int, str, str | None]]:
    """The decoder layers ``probe_layers`` did not see because nothing in them calls attention —
    linear attention (Qwen3.5's and Qwen3-Next's Gated DeltaNet), Mamba or other recurrent mixers —
    as ``(index, qualified name, layer type)``: every other entry of the ``nn.ModuleList`` the
    observed attention layers sit in, its layer type from the config's ``layer_types`` when that
    lists one per entry (else None). Positions enter none of them (they have no RoPE: the patch
    leaves them untouched). Empty unless the observed layers are entries of one such list at the
    indices they report (a layer stack read without class names; a model sharing one attention
    module between layers, say, gets no extra rows)."""
    modules = dict(model.named_modules())
    slots = [_stack_slot(info.name, modules) for info in layers]
    stacks = {slot[0] for slot in slots if slot is not None}
    if not layers or None in slots or len(stacks) != 1 or any(s[1] != info.index for s, info in zip(slots, layers)):
        return []
    stack = stacks.pop()
    seen = {info.index for info in layers}
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    types = getattr(cfg, "layer_types", None)
    entries = list(modules[stack])
    types = list(types) if isinstance(types, (list, tuple)) and len(types) == len(entries) else None
    return [(i, f"{stack}.{i}" if stack else str(i), types[i] if types else None)
            for i in range(len(entries)) if i not in seen]
