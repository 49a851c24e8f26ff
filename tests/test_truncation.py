"""Truncation rules inside attention: the fused and blocked O(n) paths against the naive n × n
oracle (outputs and gradients), vanilla equivalence, cached decoding, padding, log-n, no host
reads of tensor values, and refusal where attention is not pluggable."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import DynamicCache

import ropescale
from ropescale.attention import AttentionNotPluggableError, logn_factor
from ropescale.attention.truncated import _Rotations, blocked_attention, fused_attention, naive_attention
from ropescale.strategies.truncation import leaky_rerope, rerope, self_extend
from tests.conftest import with_cache
from tests.families import family_model

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
