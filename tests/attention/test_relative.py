"""Truncation rules inside attention: the fused and blocked O(n) paths against the naive n × n
oracle (outputs and gradients), vanilla equivalence, cached decoding, padding, log-n, no host
reads of tensor values, and refusal where attention is not pluggable; every path makes its
masks on its inputs' device (from tests/test_device_placement.py); Dual Chunk Attention and
STRING on every path against a float64 n × n oracle written from the papers (forward and
gradients; GQA, left padding, a KV-cache split, lengths that are not multiples of the chunk),
cached decoding across chunk boundaries, STRING's prefill as the authors run it and vLLM's DCA
temperature (from tests/test_dca_string.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import DynamicCache

import ropescale
from ropescale.attention import AttentionNotPluggableError, logn_factor
from ropescale.attention.flex import flex_attention_path
from ropescale.attention.relative import _Rotations, blocked_attention, fused_attention, naive_attention
from ropescale.strategies import get_strategy
from ropescale.strategies.relative import dca, leaky_rerope, rerope, self_extend, string
from tests.conftest import with_cache
from tests.families import family_model
from tests.strategies.test_relative import dca_pair, string_pair

IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(5))
RULES = [("rerope", {"window": 8}), ("rerope", {"window": 40}), ("leaky_rerope", {"window": 16, "k": 4.0}),
         ("self_extend", {"window": 16, "group_size": 4}), ("self_extend", {"window": 8, "group_size": 3}),
         ("dca", {"chunk_size": 24, "local_window": 4}), ("string", {"shifted_offset": 20, "local_window": 3})]
FAMILIES = ["llama", "qwen2", "gemma2", "gpt_neox"]  # gemma2: eager, softcap, sliding window; neox: partial


@torch.no_grad()
def logits(model, ids=IDS, **kw):
    return model(ids, **kw).logits


@pytest.mark.parametrize("path", ["fused", "blocked"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,params", RULES, ids=[f"{s}-{p}" for s, p in RULES])
@pytest.mark.parametrize("length", [30, 100])
def test_fast_paths_equal_naive_oracle(path, family, strategy, params, length):
    model = family_model(family)
    ids = IDS[:, :length]
    with ropescale.patch(model, strategy, block_size=16, attention_path=path, **params):
        fast = logits(model, ids)
    with ropescale.patch(model, strategy, attention_path="naive", **params):
        slow = logits(model, ids)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES + ["gemma3", "phi3"])
def test_rerope_with_window_beyond_length_is_vanilla(family):
    model = family_model(family)
    base = logits(model)
    with ropescale.patch(model, "rerope", window=100):
        torch.testing.assert_close(logits(model), base, rtol=0, atol=1e-5)
    assert torch.equal(logits(model), base)  # unpatch is exact


def test_rule_changes_logits_past_the_window():
    model = family_model("llama")
    base = logits(model)
    with ropescale.patch(model, "rerope", window=8):
        assert not torch.allclose(logits(model), base, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
@pytest.mark.parametrize("strategy,params", RULES[::2], ids=[s for s, _ in RULES[::2]])
def test_cached_decoding_equals_full_forward(family, strategy, params):
    model = family_model(family)
    with torch.no_grad(), ropescale.patch(model, strategy, block_size=16, **params):
        cache = DynamicCache(config=model.config)
        model(IDS[:, :70], **with_cache(cache), use_cache=True)
        for t in range(70, 85):
            step = model(IDS[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, logits(model, IDS[:, : t + 1])[:, -1], rtol=0, atol=1e-5)


def test_generate_runs_and_agrees_with_full_forward():
    model = family_model("llama")
    with torch.no_grad(), ropescale.patch(model, "self_extend", window=16, group_size=4):
        g = model.generate(IDS[:, :60], attention_mask=torch.ones_like(IDS[:, :60]), max_new_tokens=10,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
        for i, step in enumerate(g.logits):
            torch.testing.assert_close(step, logits(model, g.sequences[:, : 60 + i])[:, -1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "llama"])  # gemma2 soft-caps: the blocked path
@pytest.mark.parametrize("path", ["fused", "blocked", "naive"])
def test_left_padded_batch_equals_rows_alone(path, family):
    model = family_model(family)
    short = IDS[1:2, 12:80]
    batch = torch.cat([IDS[0:1, :80], torch.cat([torch.zeros(1, 12, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :12] = 0
    with ropescale.patch(model, "leaky_rerope", window=16, k=4.0, attention_path=path):
        out = logits(model, batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        torch.testing.assert_close(out[1, 12:], logits(model, short)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[0], logits(model, IDS[0:1, :80])[0], rtol=0, atol=1e-5)


def test_logn_with_a_truncation_rule_matches_queries_scaled_at_q_proj():
    model = family_model("llama")
    scale = logn_factor(torch.arange(100)[None], 64)[..., None]
    hooks = [m.register_forward_hook(lambda mod, a, out: out * scale[:, : out.shape[1]])  # patch probes 2 tokens
             for n, m in model.named_modules() if n.endswith("q_proj")]
    with ropescale.patch(model, "rerope", window=16, attention_path="naive"):
        expected = logits(model)
    for h in hooks:
        h.remove()
    with ropescale.patch(model, "rerope", window=16, logn=True):
        torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)


def test_falcon_is_refused_not_silently_vanilla():
    model = family_model("falcon")
    base = logits(model)
    with pytest.raises(AttentionNotPluggableError, match="does not route attention"):
        ropescale.patch(model, "rerope", window=8)
    assert ropescale.current_patch(model) is None and torch.equal(logits(model), base)


def test_bad_attention_options():
    model = family_model("llama")
    with pytest.raises(ValueError, match="attention_path='flash'; choose 'fused', 'blocked' or 'naive'"):
        ropescale.patch(model, "rerope", attention_path="flash")
    with pytest.raises(ValueError, match="block_size=0"):
        ropescale.patch(model, "rerope", block_size=0)


@pytest.mark.parametrize("rule", [rerope(8), leaky_rerope(8, 4.0, None, 64), self_extend(4, 8)])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_kernel_block_sizes_and_gqa_against_oracle(rule, block):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 6, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g),
               torch.randn(2, 2, 40, 16, generator=g))
    pos = torch.arange(40).float()[None].expand(2, -1)
    inv = 1.0 / (10000 ** (torch.arange(0, 10, 2).float() / 10))  # partial rotary: 10 of 16 channels
    for interleaved in (False, True):
        a = blocked_attention(q, k, v, pos, pos, rule, inv, 1.2, scale=0.25, block=block, interleaved=interleaved,
                              softcap=5.0, sliding_window=30)
        b = naive_attention(q, k, v, pos, pos, rule, inv, 1.2, scale=0.25, interleaved=interleaved,
                            softcap=5.0, sliding_window=30)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _inputs(b, n_h, n_kv, s_q, s_k, h_d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_h, s_q, h_d, generator=g).requires_grad_()
    k, v = (torch.randn(b, n_kv, s_k, h_d, generator=g).requires_grad_() for _ in range(2))
    return q, k, v


def _close_grads(got, want, rtol=1e-5):
    """≤ rtol relative to the largest gradient entry (a gradient can be exactly 0 — one key per
    query — where the kernels' float noise has no relative scale of its own)."""
    scale = max(b.abs().max() for b in want)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= rtol * scale, ((a - b).abs().max(), scale)


@settings(max_examples=40, deadline=None)
@given(s_k=st.integers(1, 90), cached=st.integers(0, 89), window=st.integers(1, 40),
       rule=st.sampled_from(["rerope", "leaky", "self_extend"]), sliding=st.sampled_from([None, 5, 24, 70]),
       pad=st.integers(0, 12), gqa=st.booleans(), interleaved=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_kernel_equals_oracle_with_gradients(s_k, cached, window, rule, sliding, pad, gqa, interleaved, seed):
    """Any split of queries and cached keys, window, sliding window, left padding, GQA, partial
    and interleaved rotary: outputs and the gradients of q, k, v equal the naive path's."""
    s_q = max(1, s_k - cached)
    rule = {"rerope": rerope(window), "leaky": leaky_rerope(window, 3.0, None, 64),
            "self_extend": self_extend(3, window)}[rule]
    q, k, v = _inputs(2, 6, 2 if gqa else 6, s_q, s_k, 16, seed)
    k_pos = torch.arange(s_k).float()[None] - torch.tensor([[0.0], [min(pad, s_k - 1)]])  # row 1 left-padded
    keep = None
    if pad:
        keep = torch.ones(2, 1, 1, s_k, dtype=torch.bool)
        keep[1, ..., : min(pad, s_k - 1)] = False
    inv = 1.0 / (10000 ** (torch.arange(0, 12, 2).float() / 12))  # 12 of 16 channels rotate
    kw = dict(keep=keep, scale=0.3, sliding_window=sliding, interleaved=interleaved)
    args = (q, k, v, k_pos[:, s_k - s_q :], k_pos, rule, inv, 1.1)
    out, ref = fused_attention(*args, **kw), naive_attention(*args, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    _close_grads(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "gemma2"])
@pytest.mark.parametrize("path", ["fused", "blocked"])
@pytest.mark.parametrize("strategy,params", RULES[1:4], ids=[s for s, _ in RULES[1:4]])
def test_parameter_gradients_equal_naive_path(family, path, strategy, params):
    """A training step's gradients through a patched tiny model: every parameter's gradient
    equals the naive path's (≤ 1e-5 relative). gemma2 soft-caps, so its fused path is blocked."""
    grads = {}
    for p in (path, "naive"):
        model = family_model(family)
        with ropescale.patch(model, strategy, attention_path=p, block_size=16, **params):
            model(IDS[:, :100], labels=IDS[:, :100]).loss.backward()
        grads[p] = [w.grad for w in model.parameters()]
    for got, want in zip(grads[path], grads["naive"], strict=True):  # each parameter on its own scale
        _close_grads([got], [want])


def test_blocked_attention_dropout_is_softmax_dropout():
    """Dropout acts on the normalised weights, as eager attention's: the same draw applied to the
    oracle's probabilities gives the same output."""
    q, k, v = _inputs(1, 4, 2, 30, 30, 16, 3)
    pos = torch.arange(30).float()[None]
    rule, inv = rerope(8), 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    torch.manual_seed(0)
    out = blocked_attention(q, k, v, pos, pos, rule, inv, 1.0, scale=0.25, dropout=0.3, block=64)
    # oracle probabilities: softmax over the rule's scores, from the naive path with v = identity
    eye = torch.eye(30)[None, None].expand(1, 2, 30, 30)
    probs = naive_attention(q, k.detach(), eye, pos, pos, rule, inv, 1.0, scale=0.25)  # [1, 4, 30, 30]
    torch.manual_seed(0)
    dropped = torch.nn.functional.dropout(probs.view(1, 2, 2, 30, 30), 0.3).view(1, 4, 30, 30)
    torch.testing.assert_close(out, dropped @ v.repeat_interleave(2, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", [fused_attention, blocked_attention])
def test_kernels_never_read_tensor_values_on_the_host(kernel):
    """Under FakeTensorMode a tensor has no values: any int()/bool()/if on one (a device → host
    sync on a GPU) raises. Forward and backward run through, with padding and a sliding window."""
    with FakeTensorMode():
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        q, k, v = (torch.randn(1, 4, 300, 16, requires_grad=True) for _ in range(3))
        pos = torch.arange(300).float()[None]
        keep = torch.ones(1, 1, 1, 300, dtype=torch.bool)
        for kw in ({}, {"keep": keep, "sliding_window": 100}):
            out = kernel(q, k, v, pos, pos, self_extend(4, 32), inv, 1.0, scale=0.25, block=64, **kw)
            out.sum().backward()
            assert q.grad.shape == q.shape
        with pytest.raises(DataDependentOutputException):  # the mode does catch host reads
            int(q.sum())


def _float64_oracle(q, k, v, q_pos, k_pos, rule, inv, scaling, *, keep, scale, sliding_window, interleaved):
    """The two regions spelled out in float64: near pairs (slot distance < w) score with q and k
    rotated to their own positions, far pairs with q at f_q and k at f_k (the tables as the
    kernel builds them: float32 angles, cast), causal and sliding-window by slot, n × n softmax."""
    n_h, s_q, s_k = q.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(n_h // k.shape[1], 1), v.repeat_interleave(n_h // v.shape[1], 1)
    rot = _Rotations(q_pos, k_pos, rule, inv, scaling, interleaved)
    near = rot(q, "q", 0) @ rot(k, "k", 0).transpose(-1, -2)
    far = rot(q, "q", 1) @ rot(k, "k", 1).transpose(-1, -2)
    dist = (torch.arange(s_k - s_q, s_k)[:, None] - torch.arange(s_k)[None])  # slot distance i − j
    s = torch.where(dist < rule.window, near, far) * scale
    vis = (dist >= 0) & (dist < sliding_window if sliding_window else True)
    if keep is not None:
        vis = vis & keep
    return torch.nan_to_num(torch.softmax(s.masked_fill(~vis, float("-inf")), -1)) @ v


@pytest.mark.parametrize("s_k,cached,window,rule,sliding,pad,gqa,interleaved", [
    (60, 0, 8, "rerope", None, 0, False, False),
    (90, 30, 16, "leaky", 24, 5, True, False),
    (70, 69, 12, "self_extend", None, 3, True, True),
    (45, 10, 40, "rerope", 70, 0, False, True),
])
def test_fused_kernel_in_float64_with_gradients(s_k, cached, window, rule, sliding, pad, gqa, interleaved):
    """float64 in: forward and backward run in float64 — equal to the naive path (exact in float64;
    the kernel's angles are float32, as transformers computes them) to 1e-5, and to the regions
    spelled out with the kernel's tables in float64 at float64 precision."""
    s_q = max(1, s_k - cached)
    rule = {"rerope": rerope(window), "leaky": leaky_rerope(window, 3.0, None, 64),
            "self_extend": self_extend(3, window)}[rule]
    q, k, v = (x.detach().double().requires_grad_() for x in _inputs(2, 6, 2 if gqa else 6, s_q, s_k, 16, 7))
    k_pos = torch.arange(s_k).double()[None] - torch.tensor([[0.0], [float(min(pad, s_k - 1))]], dtype=torch.float64)
    keep = None
    if pad:
        keep = torch.ones(2, 1, 1, s_k, dtype=torch.bool)
        keep[1, ..., : min(pad, s_k - 1)] = False
    inv = 1.0 / (10000 ** (torch.arange(0, 12, 2).double() / 12))
    kw = dict(keep=keep, scale=0.3, sliding_window=sliding, interleaved=interleaved)
    args = (q, k, v, k_pos[:, s_k - s_q :], k_pos, rule, inv, 1.1)
    out = fused_attention(*args, **kw)
    assert out.dtype == torch.float64
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert all(g.dtype == torch.float64 for g in got)
    naive = naive_attention(*args, **kw)
    torch.testing.assert_close(out, naive.double(), rtol=0, atol=1e-5)
    _close_grads(got, torch.autograd.grad(naive, (q, k, v), grad.float()))
    exact = _float64_oracle(*args, **kw)
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-12)
    _close_grads(got, torch.autograd.grad(exact, (q, k, v), grad), rtol=1e-12)


def _exact_attention(q, k, v, q_pos, k_pos, pair, inv, scaling, scale):
    """softmax over j ≤ i of R(a)q_i · R(b)k_j · scale with (a, b) = pair(i, j) from Python floats,
    every rotation, score and the softmax in float64 (rotate-half layout, cos/sin × ``scaling``)."""
    q, k, v = q.double(), k.double(), v.double()
    d = 2 * inv.numel()

    def rot(x, t):  # x [..., h_d] at position t (a Python float)
        ang = t * inv.double()
        cos, sin = ang.cos() * scaling, ang.sin() * scaling
        x1, x2 = x[..., : d // 2], x[..., d // 2 : d]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., d:]), -1)

    s_q, s_k = q.shape[2], k.shape[2]
    s = torch.full((q.shape[0], q.shape[1], s_q, s_k), float("-inf"), dtype=torch.float64)
    for t in range(s_q):
        for j in range(s_k - s_q + t + 1):
            a, b = pair(q_pos[0, t].item(), k_pos[0, j].item())
            s[:, :, t, j] = (rot(q[:, :, t], a) * rot(k[:, :, j], b)).sum(-1) * scale
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_naive_oracle_is_exact_far_into_a_sequence(dtype, atol):
    """The oracle computes positions, p, the angles p·θ and the softmax in float64: deep in a
    sequence (positions near 30 000, Leaky ReRoPE's far positions i/k) it equals the rule written
    out with Python floats to float64 precision, returned in the inputs' dtype. (It scored in
    float32 before: p = i/k − j/k from float32 positions was off by about 1e-3, and so were the
    angles p·θ of large p.)"""
    w, kk = 8, 3.0
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen, dtype=dtype) for _ in range(3))
    pos = (torch.arange(40, dtype=dtype) + 29_983)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, 12, 2).float() / 12))  # 12 of 16 channels rotate

    def pair(i, j):  # Leaky ReRoPE: q at i, k at j near; q at i/k + w(1 − 1/k), k at j/k far
        return (i, j) if i - j < w else (i / kk + w * (1 - 1 / kk), j / kk)

    out = naive_attention(q, k, v, pos, pos, leaky_rerope(w, kk, None, 64), inv, 1.1, scale=0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _exact_attention(q, k, v, pos, pos, pair, inv, 1.1, 0.3),
                               rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_naive_path_runs_models_in_any_dtype(dtype):
    """The naive path returns the model's dtype (it returned float32, so a float64 or bfloat16
    model's o_proj refused its output: "expected m1 and m2 to have the same dtype")."""
    model = family_model("llama").to(dtype)
    with torch.no_grad():
        with ropescale.patch(model, "rerope", window=8, attention_path="naive"):
            slow = logits(model, IDS[:, :40])
        with ropescale.patch(model, "rerope", window=8):
            fast = logits(model, IDS[:, :40])
    assert slow.dtype == dtype
    tol = 1e-6 if dtype == torch.float64 else 0.1
    torch.testing.assert_close(slow, fast, rtol=0, atol=tol)


# --- every tensor a path makes for itself lives on its inputs' device ---------------------------
# Every tensor an attention path makes for itself lives on its inputs' device. Measured on an H100 (issue 31):
# the naive oracle built its causal mask on the CPU, so every CUDA oracle check failed with "expected self and
# mask to be on the same device". Here the inputs sit on the meta device: a helper tensor made on the CPU
# meets them and fails the same way, on a machine without a GPU.

@pytest.mark.parametrize("path", [naive_attention, blocked_attention])
@pytest.mark.parametrize("rule", ["rerope", "dca"])
@pytest.mark.parametrize("padded", [False, True])
def test_the_path_makes_its_masks_on_the_inputs_device(path, rule, padded):
    strat = get_strategy(rule)
    params = strat.validate({"window": 8} if rule == "rerope" else {"chunk_size": 12, "local_window": 2})
    r = strat.compute({"dim": 16, "rope_theta": 1e4, "original_max_position_embeddings": 16}, params)
    meta = torch.device("meta")
    q = torch.empty(2, 4, 20, 16, device=meta)
    k = v = torch.empty(2, 2, 20, 16, device=meta)
    pos = torch.arange(20, device=meta).float()[None].expand(2, -1)
    keep = torch.ones(2, 1, 1, 20, dtype=torch.bool, device=meta) if padded else None
    out = path(q, k, v, pos, pos, r, torch.ones(8, device=meta), 1.0, keep=keep, scale=0.25)
    assert out.device == meta and out.shape == (2, 4, 20, 16)



# --- Dual Chunk Attention and STRING -------------------------------------------------------------

DCA_IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(11))


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


@functools.cache
def _oracle_case(name, s_k, cached, n_kv, pad):
    """A case's inputs, the oracle's output and its gradients for an upstream gradient ``g`` (the oracle,
    a Python loop over pairs, computed once for the three paths)."""
    gen = torch.Generator().manual_seed(s_k)
    s_q = s_k - cached
    q = torch.randn(2, 4, s_q, 16, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(2, n_kv, s_k, 16, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, n_kv, s_k, 16, generator=gen, dtype=torch.float64).requires_grad_()
    inv = (1.0 / (100 ** (torch.arange(0, 12, 2) / 12))).float().double()  # float32-exact: 12 of 16 rotate
    pads = [0, pad]
    keep = torch.ones(2, 1, 1, s_k, dtype=torch.bool)
    keep[1, ..., :pad] = False
    positions = [[s - p if s >= p else None for s in range(s_k)] for p in pads]
    rule = _rule(name)
    want = oracle(q, k, v, positions, _pair(name), inv, rule.attention_factor, 0.3,
                  [[bool(x) for x in keep[r, 0, 0]] for r in range(2)])
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    exp = torch.autograd.grad(want, (q, k, v), g)
    return (q.detach(), k.detach(), v.detach()), inv, pads, keep, want.detach(), g, exp


@pytest.mark.parametrize("path", ["fused", "blocked", "flex"])
@pytest.mark.parametrize("name,s_k,cached,n_kv,pad", CASES)
def test_every_path_equals_the_float64_oracle_with_gradients(path, name, s_k, cached, n_kv, pad):
    (q, k, v), inv, pads, keep, want, g, exp = _oracle_case(name, s_k, cached, n_kv, pad)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s_q = s_k - cached
    k_pos = torch.stack([torch.arange(s_k, dtype=torch.float64) - p for p in pads])  # [2, s_k]
    rule = _rule(name)
    kw = {"keep": keep if pad else None, "scale": 0.3}
    args = (q, k, v, k_pos[:, s_k - s_q :], k_pos, rule, inv, rule.attention_factor)
    if path == "flex":
        with torch.no_grad():  # FlexAttention has no backward on the CPU (and refuses inputs that need one)
            out = flex_attention_path(q.detach(), k.detach(), v.detach(), *args[3:], **kw)
    else:
        out = (fused_attention if path == "fused" else blocked_attention)(*args, block=16, **kw)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    if path != "flex":
        got = torch.autograd.grad(out, (q, k, v), g)
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
        model(DCA_IDS[:, :70], **with_cache(cache), use_cache=True)
        for t in range(70, 85):
            step = model(DCA_IDS[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            full = model(DCA_IDS[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,params", [("dca", {"chunk_size": 24, "local_window": 4}),
                                             ("string", {"shifted_offset": 20, "local_window": 3})])
def test_generate_with_left_padding_equals_each_row_alone(strategy, params):
    """A batch with left padding: each row's logits equal the row run alone (chunks follow each
    row's own positions)."""
    model = family_model("llama")
    ids = DCA_IDS[:, :60].clone()
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
    ids = DCA_IDS[:, :90]
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
        base = model(DCA_IDS[:, :40]).logits
        with ropescale.patch(model, "string", shifted_offset=60, local_window=3, attention_factor=1.0):
            torch.testing.assert_close(model(DCA_IDS[:, :40]).logits, base, rtol=0, atol=1e-5)


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
    ids = DCA_IDS[:, :60]
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
            want = model(DCA_IDS[:, :50]).logits
        with ropescale.patch(model, "dca", chunk_size=np.int64(24), local_window=np.int32(4)) as handle:
            torch.testing.assert_close(model(DCA_IDS[:, :50]).logits, want, rtol=0, atol=0)
            assert handle.params["chunk_size"] == 24 and type(handle.params["chunk_size"]) is int
    for bad, shown in ((float("inf"), "inf"), (float("nan"), "nan"), (np.float64("-inf"), "-inf")):
        with pytest.raises(InvalidInput) as e:
            ropescale.patch(model, "dca", chunk_size=bad)
        assert str(e.value) == f"dca: parameter chunk_size={shown} must be a finite whole number; allowed: >= 2"



def test_a_fake_trace_leaves_no_fake_mask_for_a_real_forward():
    """A memory trace (FakeTensorMode) of the same shapes must not fill the band-mask cache with
    fake tensors that a later real forward then reads (seen in CI: the estimator's trace, then
    a real Gemma 3 sweep in the same process)."""
    rule = self_extend(4, 32)

    def run():
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
        pos = torch.arange(300).float()[None]
        return fused_attention(q, k, v, pos, pos, rule, inv, 1.0, scale=0.25, block=64)

    with FakeTensorMode():
        run()
    out = run()
    assert type(out) is torch.Tensor and torch.isfinite(out).all()
