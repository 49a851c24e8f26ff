"""Dual Chunk Attention and STRING: position maps against the papers' figures and formulas, every
attention path against a float64 n × n oracle written from the papers (forward and gradients;
GQA, left padding, a KV-cache split, lengths that are not multiples of the chunk), cached decoding
against full forwards across chunk boundaries, and the strategies' defaults and refusals."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import ropescale
from ropescale.attention.flex import flex_attention_path
from ropescale.attention.truncated import blocked_attention, fused_attention, naive_attention
from ropescale.strategies import get_strategy
from ropescale.strategies.truncation import dca, string
from tests.conftest import with_cache
from tests.families import family_model

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(11))


# --- the papers' position maps, written per (i, j) with Python integers -------------------------

def dca_pair(i: int, j: int, chunk_size: int, local_window: int) -> tuple[int, int]:
    """(query position, key position) of Dual Chunk Attention for query i, key j ≤ i (An et al.
    2024 §3, as ChunkLlama's chunkllama_attn_replace.py places them): chunks of c = chunk_size −
    local_window; keys at j mod c; queries at i mod c (same chunk), min(i mod c + c, chunk_size)
    (previous chunk), min(2c − 1, chunk_size) (earlier chunks)."""
    c = chunk_size - local_window
    gap = i // c - j // c
    q = i % c if gap == 0 else min(i % c + c, chunk_size) if gap == 1 else min(2 * c - 1, chunk_size)
    return q, j % c


def string_pair(i: int, j: int, shifted_offset: int, local_window: int) -> tuple[int, int]:
    """STRING (An et al. 2024, arXiv:2410.18745, Fig. 1b): p = i − j below S, i − j − S + W from S."""
    return (i, j) if i - j < shifted_offset else (i - shifted_offset + local_window, j)


def test_dca_positions_match_the_papers_figure():
    """The paper's example (pretraining length 10, chunk length s = 6, w = 4 exact successive
    positions: successive queries at 6, 7, 8, 9, 9, 9 and inter queries at 9) is chunk_size = 9,
    local_window = 3 in ChunkLlama's parametrisation (chunk length = chunk_size − local_window)."""
    rule = dca(9, 3, 1.0, False, 12)
    pos = torch.arange(18.0)[None]
    p = rule.relative_positions(pos, pos)[0]
    assert [p[6 + r, 0].item() for r in range(6)] == [6, 7, 8, 9, 9, 9]  # successive: key 0 at 0
    assert [p[12 + r, 3].item() for r in range(6)] == [6, 6, 6, 6, 6, 6]  # inter: queries at 9, key at 3
    assert [p[15, j].item() for j in range(12, 16)] == [3, 2, 1, 0]  # intra: exact
    assert p.max().item() == 9  # never beyond the largest trained position used


def test_string_positions_match_the_papers_figure():
    """Fig. 1b: S = 42K, W = 128, L = 128K: distance 42K − 1 stays, 42K becomes 128 and the
    largest, 128K − 1, becomes 86K + 127."""
    k = 1024
    rule = string(42 * k, 128, None, 128 * k)
    q = torch.tensor([[42 * k - 1.0, 42 * k, 128 * k - 1.0]])
    got = rule.relative_positions(q, torch.zeros(1, 1))[0, :, 0]
    assert got.tolist() == [42 * k - 1, 128, 86 * k + 127]


@pytest.mark.parametrize("chunk_size,local_window", [(9, 3), (24, 4), (10, 0), (7, 6)])
def test_dca_map_is_the_papers_formula_everywhere(chunk_size, local_window):
    rule = dca(chunk_size, local_window, 1.0, False, 64)
    pos = torch.arange(60.0)[None]
    p = rule.relative_positions(pos, pos)[0]
    for i in range(60):
        for j in range(i + 1):
            a, b = dca_pair(i, j, chunk_size, local_window)
            assert p[i, j].item() == a - b, (i, j)


@pytest.mark.parametrize("s,w", [(20, 3), (5, 0), (30, 29)])
def test_string_map_is_the_papers_formula_everywhere(s, w):
    p = string(s, w, None, 64).relative_positions(torch.arange(60.0)[None], torch.arange(60.0)[None])[0]
    for i in range(60):
        for j in range(i + 1):
            a, b = string_pair(i, j, s, w)
            assert p[i, j].item() == a - b, (i, j)


def test_defaults_are_the_authors():
    assert get_strategy("dca").validate({}) == {"chunk_size": None, "local_window": None, "scale": 1.0,
                                               "vllm_temperature": False}
    rule = dca(None, None, 1.0, False, 4096)  # ChunkLlama: chunk_size 3T/4 = 3072, local_window T/8 = 512
    pos = torch.tensor([[10_000.0]])
    c = 3072 - 512
    assert rule.relative_positions(pos, torch.tensor([[0.0]])).item() == 3072  # inter: min(2c − 1, 3072) − 0
    assert rule.relative_positions(pos, torch.tensor([[10_000.0 - c]])).item() == min(10_000 % c + c, 3072) - (
        (10_000 - c) % c)
    s = string(None, None, None, 131072)  # the authors' S = int(0.33 L), W = 128, factor 0.1 ln 2 + 1
    assert s.window == int(0.33 * 131072)
    assert s.relative_positions(torch.tensor([[131071.0]]), torch.zeros(1, 1)).item() == 131071 - 43253 + 128
    assert s.attention_factor == pytest.approx(0.1 * math.log(2) + 1)


def test_temperatures():
    assert dca(24, 4, 1.0, False, 32).attention_factor == 1.0
    assert dca(24, 4, 8.0, False, 32).attention_factor == pytest.approx(0.05 * math.log(8) + 1)  # ChunkLlama
    assert dca(24, 4, 8.0, True, 32).attention_factor == pytest.approx(0.1 * math.log(8) + 1)  # vLLM
    assert get_strategy("dca").resolve({}, length=512, train_length=128)["scale"] == 4.0  # a sweep: L / T


@pytest.mark.parametrize("strategy,params,match", [
    ("dca", {"chunk_size": 8, "local_window": 8}, "below chunk_size"),
    ("string", {"shifted_offset": 8, "local_window": 8}, "below shifted_offset"),
])
def test_bad_sizes_are_one_line(strategy, params, match):
    model = family_model("llama")
    with pytest.raises(ValueError, match=match):
        ropescale.patch(model, strategy, **params)


# --- the float64 oracle: per pair, q rotated to its region's query position, k to its key position

def _rotate64(x, pos, inv, factor):
    """RoPE (rotate-half layout) in float64 at integer positions ``pos`` [..., s]: x [..., s, h_d];
    cos and sin × ``factor`` (as transformers' attention_scaling: rotary channels only)."""
    ang = pos[..., None].double() * inv.double()  # [..., s, d/2]
    cos, sin = ang.cos() * factor, ang.sin() * factor
    d = 2 * inv.numel()
    x1, x2 = x[..., : d // 2], x[..., d // 2 : d]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., d:]), -1)


def oracle(q, k, v, positions, pair, inv, factor, scale, keep):
    """softmax over j ≤ i of (factor·R(a_ij) q_i · factor·R(b_j) k_j)·scale (the rotary channels
    scaled, the rest not), (a_ij, b_j) = pair(i, j)
    on each row's positions (``positions`` [b][s_k] ints, None for padding slots)."""
    b, n_h, s_q, _ = q.shape
    s_k = k.shape[2]
    k = k.repeat_interleave(n_h // k.shape[1], 1)
    v = v.repeat_interleave(n_h // v.shape[1], 1)
    rows = []
    for r in range(b):
        s = torch.full((n_h, s_q, s_k), float("-inf"), dtype=torch.float64)
        for t in range(s_q):
            i = positions[r][s_k - s_q + t]
            for j_slot in range(s_k - s_q + t + 1):
                j = positions[r][j_slot]
                if j is None or not keep[r][j_slot]:
                    continue
                a, bk = pair(i, j)
                qa = _rotate64(q[r, :, t], torch.tensor(float(a)), inv, factor)  # [n_h, h_d]
                kb = _rotate64(k[r, :, j_slot], torch.tensor(float(bk)), inv, factor)
                s[:, t, j_slot] = (qa * kb).sum(-1) * scale
        rows.append(torch.nan_to_num(torch.softmax(s, -1)) @ v[r])
    return torch.stack(rows)


CASES = [  # rule, s_k, cached, n_kv, pad (row 1)
    ("dca", 45, 0, 4, 0),     # 45 = 2 chunks of 20 + 5: not a multiple
    ("dca", 57, 20, 2, 7),    # GQA, left padding (rows chunk differently), a KV-cache split
    ("dca", 31, 30, 1, 3),    # one decoding query
    ("string", 45, 0, 4, 0),
    ("string", 50, 13, 2, 6),
]


def _rule(name):
    return dca(24, 4, 3.0, False, 32) if name == "dca" else string(17, 5, None, 64)


def _pair(name):
    return (lambda i, j: dca_pair(i, j, 24, 4)) if name == "dca" else (lambda i, j: string_pair(i, j, 17, 5))


@pytest.mark.parametrize("path", ["fused", "blocked", "flex"])
@pytest.mark.parametrize("name,s_k,cached,n_kv,pad", CASES)
def test_every_path_equals_the_float64_oracle_with_gradients(path, name, s_k, cached, n_kv, pad):
    gen = torch.Generator().manual_seed(s_k)
    s_q = s_k - cached
    q = torch.randn(2, 4, s_q, 16, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(2, n_kv, s_k, 16, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, n_kv, s_k, 16, generator=gen, dtype=torch.float64).requires_grad_()
    inv = (1.0 / (100 ** (torch.arange(0, 12, 2) / 12))).float().double()  # float32-exact: 12 of 16 rotate
    pads = [0, pad]
    k_pos = torch.stack([torch.arange(s_k, dtype=torch.float64) - p for p in pads])  # [2, s_k]
    keep = torch.ones(2, 1, 1, s_k, dtype=torch.bool)
    keep[1, ..., :pad] = False
    rule = _rule(name)
    kw = {"keep": keep if pad else None, "scale": 0.3}
    args = (q, k, v, k_pos[:, s_k - s_q :], k_pos, rule, inv, rule.attention_factor)
    if path == "flex":
        with torch.no_grad():  # FlexAttention has no backward on the CPU (and refuses inputs that need one)
            out = flex_attention_path(q.detach(), k.detach(), v.detach(), *args[3:], **kw)
    else:
        out = (fused_attention if path == "fused" else blocked_attention)(*args, block=16, **kw)
    positions = [[s - p if s >= p else None for s in range(s_k)] for p in pads]
    want = oracle(q, k, v, positions, _pair(name), inv, rule.attention_factor, 0.3,
                  [[bool(x) for x in keep[r, 0, 0]] for r in range(2)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    if path != "flex":
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(out, (q, k, v), g)
        exp = torch.autograd.grad(want, (q, k, v), g)
        for a, b in zip(got, exp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])  # gemma2: sliding window + softcap
@pytest.mark.parametrize("strategy,params", [("dca", {"chunk_size": 24, "local_window": 4}),
                                             ("string", {"shifted_offset": 20, "local_window": 3})])
def test_cached_decoding_equals_full_forward_across_chunk_boundaries(family, strategy, params):
    """Prefill 70 tokens, then decode 15: DCA's chunks (c = 20) turn over at 80."""
    model = family_model(family)
    with torch.no_grad(), ropescale.patch(model, strategy, **params):
        cache = DynamicCache(config=model.config)
        model(IDS[:, :70], **with_cache(cache), use_cache=True)
        for t in range(70, 85):
            step = model(IDS[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            full = model(IDS[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,params", [("dca", {"chunk_size": 24, "local_window": 4}),
                                             ("string", {"shifted_offset": 20, "local_window": 3})])
def test_generate_with_left_padding_equals_each_row_alone(strategy, params):
    """A batch with left padding: each row's logits equal the row run alone (chunks follow each
    row's own positions)."""
    model = family_model("llama")
    ids = IDS[:, :60].clone()
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad(), ropescale.patch(model, strategy, **params):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        alone = model.generate(ids[1:, 9:], attention_mask=mask[1:, 9:], max_new_tokens=6, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    for step_batch, step_alone in zip(out.logits, alone.logits, strict=True):
        torch.testing.assert_close(step_batch[1:], step_alone, rtol=0, atol=1e-4)


def test_logn_composes():
    """log-n scales queries by log_T(n) before any rule; with DCA it equals the naive path."""
    model = family_model("llama")
    ids = IDS[:, :90]
    with torch.no_grad():
        with ropescale.patch(model, "dca", chunk_size=24, local_window=4, logn=True,
                             original_max_position_embeddings=32):
            fast = model(ids).logits
        with ropescale.patch(model, "dca", chunk_size=24, local_window=4, logn=True, attention_path="naive",
                                 original_max_position_embeddings=32):
            slow = model(ids).logits
        with ropescale.patch(model, "dca", chunk_size=24, local_window=4):
            plain = model(ids).logits
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert not torch.allclose(fast, plain, atol=1e-3)


def test_string_below_its_offset_is_vanilla_up_to_its_factor():
    """Below S every pair is i − j: with attention_factor 1, STRING is vanilla RoPE exactly."""
    model = family_model("llama")
    with torch.no_grad():
        base = model(IDS[:, :40]).logits
        with ropescale.patch(model, "string", shifted_offset=60, local_window=3, attention_factor=1.0):
            torch.testing.assert_close(model(IDS[:, :40]).logits, base, rtol=0, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 90), cached=st.integers(0, 89), chunk_size=st.integers(2, 30), local=st.integers(0, 29),
       pad=st.integers(0, 10))
def test_fused_kernel_equals_the_explicit_map_for_any_chunking(n, cached, chunk_size, local, pad):
    """Property: for any lengths, cache split, chunking and left padding, the fused kernel equals
    attention over the explicit position map (whose entries the tests above check against the
    paper) — every row's last chunk position included. (The kernel's angles are
    float32, as transformers computes them; the map path is exact in float64: 1e-5.)"""
    local = local % chunk_size
    s_q, pad = max(1, n - cached), min(pad, n - 1)
    gen = torch.Generator().manual_seed(n * 31 + chunk_size)
    q = torch.randn(2, 2, s_q, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 1, n, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.stack([torch.arange(n, dtype=torch.float64), torch.arange(n, dtype=torch.float64) - pad])
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[1, ..., :pad] = False
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).double() / 16))
    args = (q, k, v, pos[:, n - s_q :], pos, dca(chunk_size, local, 1.0, False, 32), inv, 1.0)
    kw = {"scale": 0.3, "keep": keep if pad else None}
    torch.testing.assert_close(fused_attention(*args, **kw), naive_attention(*args, **kw).double(), rtol=0, atol=1e-5)


def test_a_key_mask_with_batch_one_broadcasts_over_the_batch():
    """``keep`` need only broadcast to [b, 1, s_q, s_k]: a [1, 1, 1, s_k] mask serves every row."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 60, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(60, dtype=torch.float64)[None].repeat(2, 1)
    keep = torch.ones(1, 1, 1, 60, dtype=torch.bool)
    keep[..., 7] = False
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).double() / 16))
    for rule in (dca(5, 1, 1.0, False, 32), string(9, 2, None, 32)):
        args = (q, k, v, pos, pos, rule, inv, 1.0)
        torch.testing.assert_close(fused_attention(*args, scale=0.3, keep=keep),
                                   naive_attention(*args, scale=0.3, keep=keep).double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size,local", [(5, 1), (9, 3), (3, 1), (30, 2)])
def test_blocked_path_skips_only_regions_a_block_cannot_hold(chunk_size, local):
    """The blocked path decides per block pair which chunk regions it may hold from slot distances
    alone; every block size still equals the explicit map, with left padding."""
    gen = torch.Generator().manual_seed(chunk_size)
    q, k, v = (torch.randn(2, 2, 70, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = torch.stack([torch.arange(70, dtype=torch.float64), torch.arange(70, dtype=torch.float64) - 6])
    keep = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    keep[1, ..., :6] = False
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).double() / 16))
    args = (q, k, v, pos, pos, dca(chunk_size, local, 1.0, False, 32), inv, 1.0)
    want = naive_attention(*args, scale=0.3, keep=keep).double()
    for block in (1, 4, 16, 64):
        torch.testing.assert_close(blocked_attention(*args, scale=0.3, keep=keep, block=block), want, rtol=0,
                                   atol=1e-5)


# --- STRING's prefill as the authors run it ---------------------------------------------------

def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), -1)


def _flash(q, k, v, allowed, scale):
    """flash_attn_func written out: out and lse of softmax(q kᵀ · scale) over ``allowed`` [s_q, s_k]."""
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def authors_string(q, k, v, S, W, inv, factor, scale, decode=False):
    """HKUNLP/STRING string_for_llama.py @ 216cc2f, ``forward`` with its ``string_flash_forward``
    (prefill) or its flash-decoding branch (``decode``: the last query over a cache of all keys),
    flash_attn written out in torch. q, k, v ``[b, h, L, d]`` un-rotated (one head group); the
    RotaryEmbedding's cos/sin cache is ``attention_factor · cos(t θ)`` (and sin) for t < L."""
    L = k.shape[2]
    freqs = torch.outer(torch.arange(L, dtype=torch.float64), inv.double())
    emb = torch.cat((freqs, freqs), -1)
    cos_cached, sin_cached = factor * emb.cos(), factor * emb.sin()

    def apply_rotary_pos_emb(x, position_ids):
        return x * cos_cached[position_ids] + _rotate_half(x) * sin_cached[position_ids]

    position_ids = torch.arange(L)
    key_states = apply_rotary_pos_emb(k, position_ids)
    if decode:  # has_kv_cache: the query at L − 1; diag = the last S keys, shifted = the rest
        query_states_1 = apply_rotary_pos_emb(q, position_ids[-1:])
        query_states_2 = apply_rotary_pos_emb(q, position_ids[-1:] - S + W)
        shifted_size = L - S
        out1, lse1 = _flash(query_states_1, key_states[:, :, shifted_size:], v[:, :, shifted_size:],
                            torch.ones(1, S, dtype=torch.bool), scale)
        out2, lse2 = _flash(query_states_2, key_states[:, :, :shifted_size], v[:, :, :shifted_size],
                            torch.ones(1, shifted_size, dtype=torch.bool), scale)
        gap21 = 1 / (1 + torch.exp(lse2 - lse1))
        gap12 = 1 / (1 + torch.exp(lse1 - lse2))
        return out1 * gap21[..., None] + out2 * gap12[..., None]
    query_states_1 = apply_rotary_pos_emb(q, position_ids)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None]
    # flash_attn_func(causal=True, window_size=[S, 0]): keys j with i − S ≤ j ≤ i, both ends included
    diag_out, diag_lse = _flash(query_states_1, key_states, v, (j <= i) & (j >= i - S), scale)
    triangle_len = L - S
    if triangle_len <= 0:  # theirs: < 0; at L = S their [-0:] slice hands flash-attn no keys (no pair is that far)
        return diag_out
    # the shifted queries are position_ids − diag_size + local_window; their last triangle_len rows
    # against the first triangle_len keys, causal (equal lengths: row a sees keys b ≤ a)
    query_states_2 = apply_rotary_pos_emb(q[:, :, -triangle_len:], position_ids[-triangle_len:] - S + W)
    a, b_ = torch.arange(triangle_len)[:, None], torch.arange(triangle_len)[None]
    shifted_out, shifted_lse = _flash(query_states_2, key_states[:, :, :triangle_len], v[:, :, :triangle_len],
                                      b_ <= a, scale)
    head = diag_out[:, :, :S]
    lse_gap = 1 / (1 + torch.exp(diag_lse[:, :, S:] - shifted_lse))
    lse_gap_re = 1 / (1 + torch.exp(shifted_lse - diag_lse[:, :, S:]))
    tail = diag_out[:, :, S:] * lse_gap_re[..., None] + shifted_out * lse_gap[..., None]
    return torch.cat((head, tail), 2)


@pytest.mark.parametrize("path", ["fused", "blocked", "naive", "flex"])
@pytest.mark.parametrize("L,S,W", [(50, 17, 5), (40, 12, 3), (17, 17, 5), (12, 17, 5)])
def test_string_authors_prefill_equals_their_code(path, L, S, W):
    """``prefill="authors"``: every path equals the authors' prefill (keys at distance exactly S
    counted twice, at p = S and at p = W); their decoding counts each key once, and so does a
    cached call here. The default (the paper) differs from their prefill exactly there."""
    gen = torch.Generator().manual_seed(L + S)
    q, k, v = (torch.randn(1, 2, L, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    inv = (1.0 / (100 ** (torch.arange(0, 16, 2) / 16))).float().double()  # float32-exact
    pos = torch.arange(L, dtype=torch.float64)[None]
    authors = string(S, W, None, 64, prefill="authors")
    fn = {"fused": fused_attention, "blocked": blocked_attention, "naive": naive_attention,
          "flex": flex_attention_path}[path]
    kw = {"scale": 16**-0.5, "block": 8}
    f = authors.attention_factor
    with torch.no_grad():
        got = fn(q, k, v, pos, pos, authors, inv, f, **kw)
        torch.testing.assert_close(got, authors_string(q, k, v, S, W, inv, f, 16**-0.5), rtol=1e-6, atol=1e-6)
        paper = fn(q, k, v, pos, pos, string(S, W, None, 64), inv, f, **kw)
        assert torch.equal(got[:, :, :S], paper[:, :, :S]) or torch.allclose(got[:, :, :S], paper[:, :, :S])
        if L > S:  # from query S on, the doubled key changes the output
            assert (got[:, :, S:] - paper[:, :, S:]).abs().amax(-1).min() > 1e-4
            step = fn(q[:, :, -1:], k, v, pos[:, -1:], pos, authors, inv, f, **kw)  # decoding over a cache
            torch.testing.assert_close(step, authors_string(q[:, :, -1:], k, v, S, W, inv, f, 16**-0.5, decode=True),
                                       rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(step, paper[:, :, -1:], rtol=1e-6, atol=1e-6)


def test_string_prefill_option_is_validated_and_patches_a_model():
    assert get_strategy("string").validate({})["prefill"] == "paper"
    with pytest.raises(ValueError, match=r"^string: parameter prefill='author' is not a choice; allowed: one of "
                                         r"paper, authors$"):
        get_strategy("string").validate({"prefill": "author"})
    model = family_model("llama")
    ids = IDS[:, :60]
    with torch.no_grad():
        out = {}
        for path in ("fused", "naive"):
            with ropescale.patch(model, "string", shifted_offset=20, local_window=3, prefill="authors",
                                 attention_path=path):
                out[path] = model(ids).logits
        with ropescale.patch(model, "string", shifted_offset=20, local_window=3):
            paper = model(ids).logits
    torch.testing.assert_close(out["fused"], out["naive"], rtol=0, atol=1e-5)
    assert not torch.allclose(out["fused"][:, 20:], paper[:, 20:], atol=1e-4)
    torch.testing.assert_close(out["fused"][:, :20], paper[:, :20], rtol=0, atol=1e-5)


# --- vLLM's Dual Chunk Attention temperature --------------------------------------------------

def vllm_dca(q, k, v, chunk_size, local_size, original_max_position_embeddings, softmax_scale, *,
             key_lengths, query_length=None):
    """vLLM's Dual Chunk Attention written out (vllm-project/vllm @ cff7e054, the V0 backend removed
    in 0.11): ``rotary_embedding/dual_chunk_rope.py`` places queries at pos % c (intra),
    min(pos % c + c, chunk_size) (succ), ``qc_cache[c − 1]`` = min(2c − 1, chunk_size) (inter) and
    keys at pos % c, c = chunk_size − local_size; ``attention/backends/dual_chunk_flash_attn.py``
    multiplies each key by σ(n) = max(1, 0.1·ln(n / T) + 1) of the sequence length n when it is
    stored (``key[...].mul_(scaling_factor)``), then in prefill (``query_length`` None) multiplies
    the softmax scale by σ of the prompt length, in decoding the query by σ of the current length
    (``query * scaling_factor``). ``key_lengths`` [L]: the length n each key was stored at.
    q ``[h, s_q, d]`` (the last s_q positions), k, v ``[h, L, d]``, one head group."""
    L, s_q, d = k.shape[1], q.shape[1], q.shape[-1]
    c = chunk_size - local_size
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def sigma(n):
        return max(1.0, 0.1 * math.log(n / original_max_position_embeddings) + 1.0)

    def rot(x, t):  # neox style: x ``[h, s, d]`` at positions t ``[s]``
        ang = t.double()[:, None] * inv
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
        return x * cos + _rotate_half(x) * sin

    pos = torch.arange(L - s_q, L)
    q_intra, q_succ = rot(q, pos % c), rot(q, (pos % c + c).clamp(max=chunk_size))
    q_inter = rot(q, torch.full_like(pos, min(2 * c - 1, chunk_size)))
    keys = rot(k, torch.arange(L) % c) * torch.tensor([sigma(n) for n in key_lengths], dtype=torch.float64)[:, None]
    if query_length is None:
        scale = softmax_scale * sigma(L)
    else:
        scale = softmax_scale
        q_intra, q_succ, q_inter = (x * sigma(query_length) for x in (q_intra, q_succ, q_inter))
    gap = pos[:, None] // c - torch.arange(L)[None] // c  # [s_q, L]
    s = torch.where(gap == 0, q_intra @ keys.transpose(-1, -2),
                    torch.where(gap == 1, q_succ @ keys.transpose(-1, -2), q_inter @ keys.transpose(-1, -2)))
    s = (s * scale).masked_fill(torch.arange(L)[None] > pos[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v  # the per-chunk flash calls merged by their lse: one softmax


def test_vllm_temperature_squares_in_prefill_and_in_decoding():
    """``vllm_temperature``: logits × σ², as vLLM's prefill (keys × σ, softmax scale × σ) and its
    decoding (keys × σ when stored, the query × σ) both do — not once in decoding. With scale
    s = L / T ropescale equals vLLM's prefill exactly, and a decoding step whose cached keys were
    stored at the same σ (vLLM's σ follows each step's length; ropescale's ``scale`` is fixed)."""
    T, L, chunk_size, local = 16, 60, 12, 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, L, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    pos = torch.arange(L, dtype=torch.float64)[None]
    rule = dca(chunk_size, local, L / T, True, T)
    sigma = 0.1 * math.log(L / T) + 1
    assert rule.attention_factor == pytest.approx(sigma)
    with torch.no_grad():
        ours = fused_attention(q, k, v, pos, pos, rule, inv, rule.attention_factor, scale=0.25)
        theirs = vllm_dca(q[0], k[0], v[0], chunk_size, local, T, 0.25, key_lengths=[L] * L)
        torch.testing.assert_close(ours[0], theirs, rtol=1e-6, atol=1e-6)
        step = fused_attention(q[:, :, -1:], k, v, pos[:, -1:], pos, rule, inv, rule.attention_factor, scale=0.25)
        theirs = vllm_dca(q[0, :, -1:], k[0], v[0], chunk_size, local, T, 0.25, key_lengths=[L] * L, query_length=L)
        torch.testing.assert_close(step[0], theirs, rtol=1e-6, atol=1e-6)
        once = fused_attention(q[:, :, -1:], k, v, pos[:, -1:], pos, rule, inv, math.sqrt(sigma), scale=0.25)
        assert (once[0] - theirs).abs().max() > 1e-3  # σ applied once would be another attention


def test_patch_takes_numpy_numbers_and_refuses_non_finite_ones_in_one_line():
    """``ropescale.patch(model, "dca", chunk_size=...)``: numpy integers are whole numbers (main
    refused them as "must be a number"), inf and nan one line naming the parameter and its range
    (main: OverflowError / a bare "cannot convert float NaN to integer")."""
    import numpy as np

    from ropescale.errors import InvalidInput

    model = family_model("llama")
    with torch.no_grad():
        with ropescale.patch(model, "dca", chunk_size=24, local_window=4):
            want = model(IDS[:, :50]).logits
        with ropescale.patch(model, "dca", chunk_size=np.int64(24), local_window=np.int32(4)) as handle:
            torch.testing.assert_close(model(IDS[:, :50]).logits, want, rtol=0, atol=0)
            assert handle.params["chunk_size"] == 24 and type(handle.params["chunk_size"]) is int
    for bad, shown in ((float("inf"), "inf"), (float("nan"), "nan"), (np.float64("-inf"), "-inf")):
        with pytest.raises(InvalidInput) as e:
            ropescale.patch(model, "dca", chunk_size=bad)
        assert str(e.value) == f"dca: parameter chunk_size={shown} must be a finite whole number; allowed: >= 2"
