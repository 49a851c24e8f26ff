"""Bring keys already in a transformers KV cache to new rotary frequencies.

Cached keys were stored *after* RoPE: the rotary part of key j is m_old · R(a_old) k_j with
a = fl(p_j · θ) the float32 angle the rotary module computed, R the rotate-half rotation and m
the attention factor. Rotations compose, so the key a full forward with the new frequencies
would have computed is

    m_new · R(a_new) k_j = (m_new / m_old) · R(a_new) R(−a_old) · cached_j,

one elementwise rotation — no recomputation of keys. Its cos and sin are composed from
cos/sin of the *same rounded angles* the forward uses (not from (θ_new − θ_old)·p, which rounds
differently: at angles of ~100 rad that alone leaves ~1e-5 of disagreement), so re-rotated keys
match a full forward to float32 rounding. Only the first d = 2·len(inv_freq) channels of each
head rotate (partial rotary).

That fixes where cached keys point, but not what they hold: in every layer after the first,
keys and values come from hidden states that earlier layers computed with the *old* scale, so a
per-step dynamic scale cannot be made exact by rotation alone (measured on a 2-layer Llama: keys
of layer 0 within 6e-8 of a full forward, layer 1 off by 2e-5). ``CacheWatch`` therefore
offers the exact alternative: when the frequencies change, the cached prefix is recomputed.

Shapes: b = batch, n_kv = key/value heads, s = cached length, h_d = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from ropescale.compat import cache_from_kwargs

__all__ = ["CacheWatch", "WatchedRotaries", "decoder_of", "rerotate_cache", "rerotate_keys", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``x`` ``[..., d]`` → ``[-x2, x1]`` of its halves (x1 = x[..., :d/2])."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_keys(keys: torch.Tensor, positions: torch.Tensor, old: tuple[torch.Tensor, float],
                  new: tuple[torch.Tensor, float], *, start: int = 0, interleaved: bool = False,
                  sign: int = 1) -> torch.Tensor:
    """Keys ``[b, n_kv, s, h_d]`` rotated at ``positions`` ``[b, s]`` with ``old``
    ``(inv_freq, attention_scaling)`` → as if rotated with ``new``. The rotary channels are
    [start, start + d) in halves (or ``interleaved``) pairs, turned by sign·p·θ (the layer's
    ``ropescale.rotary.sites.LayerRope``). Returns a new tensor."""
    old_freq, old_scale = old
    new_freq, new_scale = new
    d = 2 * new_freq.numel()
    pos = positions.to(keys.device).float()[..., None]  # [b, s, 1]
    a_new = pos * new_freq.to(keys.device).float()  # [b, s, d/2], as the rotary forward computes it
    a_old = pos * old_freq.to(keys.device).float()
    cos = a_new.cos() * a_old.cos() + a_new.sin() * a_old.sin()  # cos(a_new − a_old)
    sin = (a_new.sin() * a_old.cos() - a_new.cos() * a_old.sin()) * sign  # sin(σ(a_new − a_old))
    ratio = new_scale / old_scale
    rot = keys[..., start : start + d].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    cos, sin = cos[:, None], sin[:, None]  # [b, 1, s, d/2]
    r1, r2 = (x1 * cos - x2 * sin) * ratio, (x2 * cos + x1 * sin) * ratio
    rot = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return torch.cat((keys[..., :start], rot.to(keys.dtype), keys[..., start + d :]), dim=-1)


@torch.no_grad()
def rerotate_cache(cache, positions: torch.Tensor, old: tuple[torch.Tensor, float],
                   new: tuple[torch.Tensor, float], layers: list) -> None:
    """Re-rotate in place the cached keys of ``layers`` (``LayerRope`` of the layers using these
    frequencies; layers without RoPE are never listed).

    ``positions`` ``[b, s_total]`` are the positions of all tokens cached so far; a layer that
    keeps fewer (sliding window) holds the most recent ones.
    """
    for info in layers:
        if info.index >= len(cache.layers):
            continue
        layer = cache.layers[info.index]
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        n = keys.shape[-2]
        layer.keys = rerotate_keys(keys, positions[:, -n:], old, new, start=info.start,
                                   interleaved=info.interleaved, sign=info.sign)


class CacheWatch:
    """One patched rotary module's view of the KV cache, for dynamic strategies: forward hooks on
    ``base_model`` (the module that calls the rotary module) and the state they keep.

    ``cache``: the forward's KV cache while it runs (None outside a forward); ``history``: token
    ids and ``position_ids`` ``[b, s]`` of the tokens the cache holds (``"recompute"`` mode);
    ``n_new``: tokens of this forward while the prefix is being recomputed.

    The pre-hook hands over the KV cache of the forward and records the tokens it holds. In
    ``"recompute"`` mode, when the new tokens would change the frequencies
    (``rotary.would_change``), it empties the cache in place and feeds the whole prefix plus the
    new tokens; the post-hook then returns only the new tokens' hidden states, so the caller
    (``generate``) sees an ordinary cached step whose logits equal a full forward.
    Raises ``RuntimeError`` when a recompute is needed but the forward got ``inputs_embeds``.
    """

    def __init__(self, rotary):
        self.rotary = rotary  # read only: its ``dynamic_cache`` mode and ``would_change``
        self.cache = None
        self.history: tuple[torch.Tensor, torch.Tensor] | None = None
        self.n_new: int | None = None

    def attach(self, base_model) -> list:
        """Register the hooks on ``base_model``; returns their handles (removed on unpatch)."""
        return [base_model.register_forward_pre_hook(self._pre, with_kwargs=True),
                base_model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _module, args, kwargs):
        cache = cache_from_kwargs(kwargs)  # `cache` from transformers 5.24, `past_key_values` before
        self.cache = cache
        if cache is None or self.rotary.dynamic_cache != "recompute":
            return None
        positional = kwargs.get("input_ids") is None and bool(args)
        ids = args[0] if positional else kwargs.get("input_ids")
        past = cache.get_seq_length()
        if ids is None:
            if past and self.history is not None:
                raise RuntimeError("ropescale: exact dynamic decoding needs input_ids, not inputs_embeds; "
                                   "patch with dynamic_cache='rerotate' to decode from embeddings")
            return None
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(past, past + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        if not past or self.history is None or self.history[0].shape[0] != ids.shape[0]:
            self.history = (ids, pos)
            return None
        full_ids = torch.cat([self.history[0], ids], dim=1)  # [b, s_cached + s]
        full_pos = torch.cat([self.history[1], pos], dim=1)
        self.history = (full_ids, full_pos)
        if not self.rotary.would_change(int(pos.max()) + 1):
            return None
        cache.reset()  # in place: the caller keeps its reference
        self.n_new = ids.shape[1]
        kwargs["position_ids"] = full_pos
        if kwargs.get("cache_position") is not None:
            kwargs["cache_position"] = torch.arange(full_ids.shape[1], device=ids.device)
        if positional:
            args = (full_ids, *args[1:])
        else:
            kwargs["input_ids"] = full_ids
        return args, kwargs

    def _post(self, _module, args, kwargs, output):
        self.cache = None
        if self.n_new is not None:
            n, self.n_new = self.n_new, None
            output.last_hidden_state = output.last_hidden_state[:, -n:]
            if getattr(output, "hidden_states", None) is not None:
                output.hidden_states = tuple(h[:, -n:] for h in output.hidden_states)
        return output


class WatchedRotaries:
    """Every patched rotary module (``ropescale.rotary.frequencies.FrequencyPatch``) as one for the KV-cache
    watch: the model recomputes its prefix once when any of them would change its frequencies."""

    def __init__(self, frequencies: list, dynamic_cache: str):
        self.frequencies, self.dynamic_cache = frequencies, dynamic_cache

    def would_change(self, seq_len: int) -> bool:
        """Whether a forward of ``seq_len`` tokens would recompute a dynamic strategy's frequencies.

        Args:
            seq_len: the sequence length [tokens].

        Returns:
            True when any watched frequency set would change.
        """
        return any(f.would_change(seq_len) for f in self.frequencies)


def decoder_of(model: nn.Module, parent: nn.Module) -> nn.Module:
    """The module whose forward takes the tokens and the KV cache: the model's decoder where it
    names one (``get_decoder``), else ``parent`` (the module holding the rotary module)."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        decoder = None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else parent
