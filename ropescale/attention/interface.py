"""Attention-side rules, plugged in through transformers' ``AttentionInterface``: log-n query
scaling and the relative-position rules (ReRoPE, Leaky ReRoPE, SelfExtend).

An attention function registered under a new name receives, per layer, ``query``
``[b, n_h, s_q, h_d]`` and ``key``/``value`` ``[b, n_kv, s_k, h_d]`` *after* RoPE (and after the
cache update), plus ``position_ids`` ``[b, s_q]`` among its keyword arguments. log-n wraps
whatever implementation the model uses — ``ALL_ATTENTION_FUNCTIONS[name]`` (sdpa,
flash_attention_2/3, flex_attention, a user's own), or for ``eager`` the modeling file's
``eager_attention_forward`` — under ``ropescale_logn_<name>``, registered with the base's own mask
function (its ``AttentionMaskInterface`` entry; none when the base has none) when first enabled —
otherwise transformers hands a new name no mask. Flash kernels are loaded by name (the name
containing "flash" is how transformers recognises them), so for those the wrapper passes the
base a view of the layer whose ``config._attn_implementation`` is the base's name, and the model
is switched through the config setter rather than ``set_attn_implementation``. The truncation
function is registered on first use too. Nothing is registered at import.

Routing check: each attention function counts its calls on the per-model state object it reads
from the layer (``_LogN`` / ``_Truncation``, set on every submodule), so ``check_routed`` can tell
whether a 2-token forward reached it — no global state.

log-n scaling (Su 2023, "Scaling attention by log n"; bojone/rerope): queries at position p
are multiplied by max(1, ln(p + 1) / ln(T)), keeping attention entropy roughly constant as
the context grows past the training window. Positions inside the window are untouched.

Relative-position rules need q and k *un-rotated*: ``patch`` swaps the rotary module for
``IdentityRotary`` (cos = 1, sin = 0, so the model's own ``apply_rotary_pos_emb`` is a no-op and
the KV cache holds un-rotated keys) and ``ropescale_truncation`` rotates them itself, per region
(``ropescale.attention.relative``). Query positions come from ``position_ids``; key positions
from slot order (the last key is the last query), which also holds with left padding and a
(sliding-window) cache.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from ropescale.attention.flex import BlockMaskCache, flex_attention_path
from ropescale.attention.relative import blocked_attention, fused_attention, fused_route, naive_attention
from ropescale.errors import InvalidInput, RopescaleError
from ropescale.strategies.relative import RelativeRule
from ropescale.temperature import Temperature

__all__ = [
    "ATTENTION_PATHS",
    "LOGN_PREFIX",
    "TRUNCATION",
    "AttentionNotPluggableError",
    "check_routed",
    "enable_logn",
    "enable_truncation",
    "logn_factor",
    "register_logn",
]

LOGN_PREFIX = "ropescale_logn_"
_LOGN_ATTR = "_ropescale_logn"  # on each submodule while log-n is on: a _LogN
_TRUNCATION_ATTR = "_ropescale_truncation"  # on each submodule while a relative-position rule is on


def _set_on_modules(model, attr: str, value) -> None:
    """State for the attention function on every submodule: the function receives the attention
    layer, which reads it there (a model's parts may hold different config objects, as
    Gemma 3's multimodal class does, so nothing is keyed by config)."""
    for m in model.modules():
        setattr(m, attr, value)


def _clear_on_modules(model, attr: str) -> None:
    for m in model.modules():
        if attr in m.__dict__:
            delattr(m, attr)


class AttentionNotPluggableError(RopescaleError, ValueError):
    """The model's attention does not go through transformers' AttentionInterface."""


def check_routed(model, name: str, state) -> None:
    """Run a 2-token forward and make sure the attention function ``name`` was called, i.e. that
    ``state.calls`` (the counter on the state object the function reads from the layers) moved.

    Some families (Falcon in transformers 5.x) compute attention themselves; a registered
    function would then be silently ignored. Raises ``AttentionNotPluggableError``.
    """
    before = state.calls
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    if state.calls == before:
        raise AttentionNotPluggableError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            f"(its layers never called {name!r}); attention-side strategies cannot be applied to it")


def logn_factor(position_ids: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """max(1, ln(p + 1) / ln(T)) for positions ``[b, s]`` → ``[b, s]`` float32."""
    scale = torch.log(position_ids.float() + 1) / math.log(original_max_position_embeddings)
    return scale.clamp(min=1.0)


def base_attention(module, base: str):
    """The attention function ``base`` (an ``AttentionInterface`` name) that ``module`` would run: its own
    modeling file's ``eager_attention_forward`` for ``"eager"``. Raises ``RuntimeError`` when that file has none."""
    if base == "eager":  # every modeling file defines its own eager function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


@dataclass
class _LogN:
    """Per-model query-temperature state, set on every submodule while it is on (log-n or another
    ``ropescale.temperature`` rule)."""

    train: int  # T [tokens]
    base: str  # the wrapped attention implementation's name
    calls: int = 0  # attention calls that went through the wrapper (check_routed)
    rule: Temperature = field(default_factory=lambda: Temperature("logn"))
    position_ids: torch.Tensor | None = None  # the rotary modules' positions of the current forward


class _ConfigAs:
    """A layer's config as the wrapped implementation must see it: ``_attn_implementation`` reads
    the base's name (flash_attention_* load their kernel by that name at call time)."""

    def __init__(self, config, name: str):
        self.__dict__.update(_config=config, _attn_implementation=name)

    def __getattr__(self, attr):
        return getattr(self._config, attr)


class _LayerAs:
    """The attention layer with ``config`` replaced by a ``_ConfigAs``; all else is the layer's."""

    def __init__(self, module, name: str):
        self.__dict__.update(_module=module, config=_ConfigAs(module.config, name))

    def __getattr__(self, attr):
        return getattr(self._module, attr)


def _is_flash(name: str) -> bool:
    """transformers' own test: an implementation whose name contains "flash" is a flash kernel,
    which ``set_attn_implementation`` and the flash forward load by that very name."""
    return is_flash_attention_requested(requested_attention_implementation=name)


def _logn_attention(module, query, key, value, attention_mask, **kwargs):
    state = getattr(module, _LOGN_ATTR)
    state.calls += 1
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # the attention gets none (Llama 4): the positions the rotary module was called with
        position_ids = state.position_ids
    if position_ids is None:
        raise InvalidInput(f"{type(module).__name__} passes no position_ids to attention and its rotary module was "
                           "not called with any: a query temperature cannot place its queries")
    position_ids = _text_positions(position_ids)[..., -query.shape[2]:]  # [b, s_q]
    scale = state.rule.factor(position_ids, state.train).to(query.dtype)  # [b, s_q]
    query = query * scale[:, None, :, None]  # [b, n_h, s_q, h_d]
    fn = base_attention(module, state.base)
    layer = _LayerAs(module, state.base) if _is_flash(state.base) else module
    return fn(layer, query, key, value, attention_mask, **kwargs)


def register_logn(base: str) -> str:
    """Register the log-n wrapper of attention implementation ``base`` as
    ``ropescale_logn_<base>``, with ``base``'s own mask function (none when ``base`` has none,
    exactly as transformers treats ``base``); returns the name. Idempotent. Raises ``ValueError``
    when ``base`` is neither ``eager`` nor a registered attention function."""
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise InvalidInput(f"log-n scaling wraps a registered attention implementation; {base!r} is not one "
                         f"(known: {', '.join(sorted(ALL_ATTENTION_FUNCTIONS))}, eager)")
    name = LOGN_PREFIX + base
    AttentionInterface.register(name, _logn_attention)
    mask = AttentionMaskInterface._global_mapping.get(base)  # what transformers itself consults
    if mask is not None:
        AttentionMaskInterface.register(name, mask)
    return name


def _capture_positions(rotaries: list, state) -> list:
    """Forward pre-hooks keeping each rotary module's ``position_ids`` on ``state`` (for layers that get none)."""
    def positions(_module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if pos is not None:
            state.position_ids = pos

    return [r.register_forward_pre_hook(positions, with_kwargs=True) for r in rotaries]


def enable_logn(model, original_max_position_embeddings: int, rule: Temperature | None = None, rotaries=()):
    """Switch ``model`` to log-n-scaled attention around whatever attention it uses; returns a
    function that switches it back. ``rotaries``: the model's rotary modules, whose calls give the query
    positions to layers that are handed none.

    Raises ``ValueError`` when the model's attention implementation is not registered (and not
    eager), and ``AttentionNotPluggableError`` when it bypasses the interface (Falcon).
    """
    current = model.config._attn_implementation
    name = register_logn(current)
    state = _LogN(int(original_max_position_embeddings), current, rule=rule or Temperature("logn"))
    _set_on_modules(model, _LOGN_ATTR, state)
    hooks = _capture_positions(list(rotaries), state)
    if _is_flash(current):
        # set_attn_implementation would try to load a flash kernel named ropescale_logn_flash_…;
        # the config setter (recursive over sub-configs) keeps "flash" in the name, so the model's
        # flash-specific handling stays on, and the wrapper shows the base its own name
        def switch(to: str) -> None:
            model.config._attn_implementation = to
    else:
        switch = model.set_attn_implementation
    return _route(model, name, current, state, hooks, _LOGN_ATTR, switch)


def _route(model, name: str, current: str, state, hooks: list, attr: str, switch=None):
    """Switch ``model`` to the attention implementation ``name`` (through ``switch``, default the public
    setter) and check that every layer goes through it (``check_routed``); returns the undo: the
    ``hooks`` removed, ``current`` back, the per-model state ``attr`` cleared from every submodule. Undone at
    once when the check raises."""
    switch = switch or model.set_attn_implementation
    switch(name)

    def restore() -> None:
        for h in hooks:
            h.remove()
        switch(current)
        _clear_on_modules(model, attr)

    try:
        check_routed(model, name, state)
    except Exception:
        restore()
        raise
    return restore


TRUNCATION = "ropescale_truncation"


def _fused_path(q, k, v, q_pos, k_pos, rule, inv_freq, scaling, *, masks=None, positions=None,
                **kw) -> torch.Tensor:
    """The default path: the fused CPU kernels (``truncated_attention.fused_attention``) on the
    CPU, FlexAttention (``flex_regions``, with the model's block-mask cache ``masks``) on other
    devices, unless ``fused_route`` says blocked."""
    route = fused_route(q.device.type, softcap=kw.get("softcap"), dropout=kw.get("dropout", 0.0), keep=kw.get("keep"),
                        by_chunk=rule.by_chunk, sliding_window=kw.get("sliding_window"))
    if route == "flex":
        return flex_attention_path(q, k, v, q_pos, k_pos, rule, inv_freq, scaling, masks=masks, positions=positions,
                                   **kw)
    return fused_attention(q, k, v, q_pos, k_pos, rule, inv_freq, scaling, **kw)


_PATHS = {"fused": _fused_path, "flex": flex_attention_path, "blocked": blocked_attention,
          "naive": naive_attention}
ATTENTION_PATHS = tuple(_PATHS)


@dataclass
class _Truncation:
    rule: RelativeRule
    layers: dict  # attention module → (LayerRope, inv_freq [d/2] × the layer's sign); absent: no RoPE
    path: str  # a key of _PATHS: "fused", "flex", "blocked" or "naive"
    block: int
    logn: int | None  # T when a query temperature is on
    temperature: Temperature | None = None  # which one (None with logn set: log-n)
    base: str = "sdpa"  # the model's own attention, which layers without RoPE keep
    calls: int = 0  # attention calls that reached the rule (check_routed)
    masks: BlockMaskCache = field(default_factory=BlockMaskCache)  # FlexAttention masks, shared by the layers
    position_ids: torch.Tensor | None = None  # the rotary modules' positions of the current forward
    full_masks: bool = False  # masks as the model builds them, per query (an indexer selected keys in them)
    seen: tuple | None = None  # (position_ids, tokens seen through its last query): read once a forward

    def tokens_seen(self, position_ids: torch.Tensor) -> int:
        """The tokens seen through the last query of a forward given ``position_ids`` (its last position + 1),
        read to the host once per forward (the layers share the tensor), for a rule cut into pieces."""
        if self.seen is None or self.seen[0] is not position_ids:
            self.seen = (position_ids, int(position_ids[..., -1].max()) + 1)
        return self.seen[1]


def keep_mask(attention_mask):
    """transformers' mask (None, bool keep-mask, or additive float) → bool keep-mask or None."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions from what a rotary module or the attention was given: 1-D positions as they
    are; M-RoPE's ``[k, b, s]`` axes when they all agree (text), else ``InvalidInput``."""
    if position_ids.dim() == 2:
        return position_ids
    if not bool((position_ids == position_ids[:1]).all()):
        raise InvalidInput("relative-position rules act on one position per token; these inputs carry multi-axis "
                           "(M-RoPE) positions that differ between axes (images, video): text only")
    return position_ids[0]


def _key_padding(keep):
    """A ``[b, 1, s_q, s_k]`` keep-mask (a base's causal mask) → ``[b, 1, 1, s_k]``: key j is a real token
    when some query sees it (the causal and sliding-window parts are the kernel's own)."""
    if keep is None or keep.shape[-2] == 1:
        return keep
    return keep.any(-2, keepdim=True)


def _selected(module, keep, kwargs: dict, query: torch.Tensor, s_k: int):
    """``keep`` ∧ the keys a sparse-attention indexer selected, as the model's own eager/sdpa path masks them:
    DSA's ``indices`` ``[b, s_q, topk]`` key slots → ``[b, 1, s_q, s_k]``; MiniMax M3's per-head ``block_indices``
    through its indexer's own ``build_block_mask`` → ``[b, n_h, s_q, s_k]``. The others are invisible to every
    region of the rule."""
    b, s_q = query.shape[0], query.shape[2]
    indices = kwargs.get("indices")
    if indices is not None:
        selected = torch.zeros(b, s_q, s_k, dtype=torch.bool, device=query.device)
        selected.scatter_(-1, indices.long(), True)  # [b, s_q, s_k]
        keep = selected[:, None] if keep is None else keep & selected[:, None]
    blocks = kwargs.get("block_indices")
    if blocks is not None:
        build = getattr(getattr(module, "indexer", None), "build_block_mask", None)
        if build is None:
            raise InvalidInput(f"{type(module).__name__} passes block_indices to attention without an indexer "
                               "whose build_block_mask expands them: relative-position rules cannot keep its selection")
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # as the layer computes them for its indexer
            position_ids = torch.arange(s_k - s_q, s_k, device=query.device)
        position_ids = (position_ids if position_ids.dim() > 1 else position_ids[None]).expand(b, -1)
        mask = build(blocks, keep, s_k, query.dtype, query.device, position_ids)  # additive [b, n_h, s_q, s_k]
        keep = keep_mask(mask)
    return keep


def _whole(x, rows: bool, cols: bool):
    """A call of one piece keeps its tensors (the same objects, which the FlexAttention mask cache recognises
    across layers)."""
    return x


def _piece(a: int, e: int, n_k: int):
    """Cut a tensor to queries [a, e) (``rows``: its dim −2 holds queries, or dim 2 for ``[b, n, s, h]`` q/k/v, or
    dim −1 for ``[b, s]`` positions) and keys [0, n_k) (``cols``); None and single-row masks pass through."""
    def cut(x, rows: bool, cols: bool):
        if x is None:
            return None
        if x.dim() == 2:  # positions [b, s]: query positions, or key positions
            return x[:, a:e] if rows else x[:, :n_k]
        if x.dim() == 4 and rows and cols:  # a keep-mask [b, n, s_q | 1, s_k]
            return (x if x.shape[-2] == 1 else x[..., a:e, :])[..., :n_k]
        return x[:, :, a:e] if rows else x[:, :, :n_k]  # q [b, n_h, s_q, h] or k, v [b, n_kv, s_k, h]
    return cut


def _truncation_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          softcap=None, sliding_window=None, **kwargs):
    state = getattr(module, _TRUNCATION_ATTR)
    state.calls += 1
    layer = state.layers.get(module)
    if layer is None:  # a layer without RoPE: the model's own attention, exactly as unpatched
        position_ids = kwargs.get("position_ids")
        position_ids = state.position_ids if position_ids is None else position_ids
        if state.logn and position_ids is not None:  # a query temperature acts in every layer
            rule = state.temperature or Temperature("logn")
            pos = _text_positions(position_ids)[..., -query.shape[2]:]  # [b, s_q]
            query = query * rule.factor(pos, state.logn).to(query.dtype)[:, None, :, None]  # [b, n_h, s_q, h_d]
        fn = base_attention(module, state.base)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap,
                  sliding_window=sliding_window, **kwargs)
    info, inv_freq = layer
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # the attention gets none: the positions the rotary module was called with
        position_ids = state.position_ids
    if position_ids is None:
        raise InvalidInput(f"{type(module).__name__} passes no position_ids to attention and its rotary module was not "
                           "called with any: relative-position rules cannot place its tokens")
    position_ids = _text_positions(position_ids)
    b, s_k = query.shape[0], key.shape[2]
    q_pos = position_ids.expand(b, -1).float()  # [b, s_q]
    if s_k == q_pos.shape[1]:  # no cache: the keys are the queries
        k_pos = q_pos
    else:  # cached keys: positions by slot, counting back from the last query's
        offset = (s_k - 1) - q_pos[:, -1:]  # slot of the last key minus its position
        k_pos = torch.arange(s_k, device=query.device).float()[None] - offset  # [b, s_k]
    if state.logn:
        rule = state.temperature or Temperature("logn")
        query = query * rule.factor(q_pos, state.logn).to(query.dtype)[:, None, :, None]
    if info.start:  # rotary channels first (DeepSeek's MLA keeps them last): the same order for q and k
        d, e = info.start, info.start + info.dim
        query = torch.cat((query[..., d:e], query[..., :d], query[..., e:]), -1)  # [b, n_h, s_q, h_d]
        key = torch.cat((key[..., d:e], key[..., :d], key[..., e:]), -1)  # [b, n_kv, s_k, h_d]
    keep = _selected(module, keep_mask(attention_mask), kwargs, query, s_k)
    v_dim = value.shape[-1]
    if v_dim != query.shape[-1]:  # MLA: values narrower (or wider) than q/k: zero-padded, cut after
        width = max(v_dim, query.shape[-1])
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x
        query, key, value = pad(query), pad(key), pad(value)
    fn = _PATHS[state.path]
    keep = keep if state.full_masks else _key_padding(keep)
    s_q, outs, seen = query.shape[2], [], s_k
    if state.rule.pieces is not None:  # the map grows with the tokens seen (GALI): cut the call into pieces
        if keep is not None:
            raise InvalidInput("a relative-position rule whose map grows with the tokens seen (gali with chunk > 0) "
                               "cuts every row at the same token counts: padded or masked batches are not supported; "
                               "run one sequence at a time, or chunk=0")
        seen = state.tokens_seen(position_ids)
    for a, e, rule in state.rule.split(s_q, seen):
        n_k = s_k - s_q + e  # the piece's keys: slots [0, n_k)
        piece = _whole if (a, e) == (0, s_q) else _piece(a, e, n_k)
        extra = {"masks": state.masks, "positions": piece(position_ids, True, False)} \
            if state.path in ("fused", "flex") else {}
        outs.append(fn(piece(query, True, False), piece(key, False, True), piece(value, False, True),
                       piece(q_pos, True, False), piece(k_pos, False, True), rule,
                       inv_freq.to(query.device), rule.attention_factor, keep=piece(keep, True, True),
                       scale=scaling or info.head_dim ** -0.5, softcap=softcap, sliding_window=sliding_window,
                       interleaved=info.interleaved, dropout=dropout, block=state.block,
                       sinks=kwargs.get("s_aux"), **extra))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)  # [b, n_h, s_q, h]
    out = out[..., :v_dim]
    return out.transpose(1, 2).contiguous(), None  # [b, s_q, n_h, h_v]


def padding_only_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **_):
    """Mask function for the relative-position rules: only which keys are real tokens, ``[b, 1, 1, s_k]``
    bool, or None without padding. The kernel applies causality and sliding windows itself, so
    no ``[b, 1, s_q, s_k]`` mask is ever built (transformers builds one for sliding layers)."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return None
    padding = padding[:, kv_offset : kv_offset + kv_length].bool()
    return None if bool(padding.all()) else padding[:, None, None, :]


def _base_for_nope(model) -> str:
    current = model.config._attn_implementation or "sdpa"
    return "sdpa" if _is_flash(current) or current.startswith(("ropescale_", TRUNCATION)) else current


def reusable_prefix(model, n: int) -> int:
    """Of the first ``n`` tokens of a prompt whose KV cache ``model`` holds, how many a longer prompt's forward
    computes alike: all n, or, under a relative-position rule whose map grows with the tokens seen (GALI's
    chunked prefill), up to its last piece cut at or before n (``Pieces.reusable``)."""
    state = getattr(model, _TRUNCATION_ATTR, None)
    pieces = state.rule.pieces if state is not None else None
    return n if pieces is None else pieces.reusable(n)


def enable_truncation(model, rule: RelativeRule, layers: dict, rotaries: list, *, path: str, block: int,
                      logn: int | None, without_rope: bool = False, temperature: Temperature | None = None,
                      full_masks: bool = False):
    """Route ``model``'s attention through the relative-position rule; returns the undo function.

    ``layers``: attention module → (``LayerRope``, its ``inv_freq`` × sign) for every layer that
    rotates; the others (``without_rope``: there are some) keep the model's own attention function and
    mask, bit for bit. ``full_masks``: an indexer selects keys in the masks, so they are kept per query
    (and built as the model's own implementation builds them). ``rotaries``:
    the rotary modules, whose calls give the positions to layers that get none. The caller has
    already set their frequencies to zero. Raises ``AttentionNotPluggableError`` when the model's
    layers bypass the interface.
    """
    current = model.config._attn_implementation
    base = _base_for_nope(model)
    name = f"{TRUNCATION}_{base}" if without_rope else TRUNCATION
    AttentionInterface.register(name, _truncation_attention)  # on first use, not at import
    if not without_rope:
        AttentionMaskInterface.register(name, padding_only_mask)
    else:  # layers without RoPE must see exactly the mask their own attention builds
        mask = AttentionMaskInterface._global_mapping.get(base)
        if mask is not None:
            AttentionMaskInterface.register(name, mask)
    state = _Truncation(rule, layers, path, block, logn, temperature, base, full_masks=full_masks)
    _set_on_modules(model, _TRUNCATION_ATTR, state)

    hooks = _capture_positions(rotaries, state)
    return _route(model, name, current, state, hooks, _TRUNCATION_ATTR)
