"""The FlexAttention path (``ropescale.attention.flex``) against the naive n × n oracle: outputs and
gradients of q, k, v (float32 and float64), GQA, left padding, a KV-cache split, sliding windows,
soft-capping; end to end on tiny models; its fallbacks and ``fused_attention``'s dispatch to it.

torch refuses FlexAttention backward on the CPU, so the gradient tests lift that guard
(``flex_backward_on_cpu``) and run FlexAttention's own autograd with its dense reference
backward — the formula the CUDA kernel compiles — through our LSE merge."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.nn.attention import flex_attention as torch_flex
from transformers import DynamicCache

import ropescale
from ropescale.attention import flex as flex_regions
from ropescale.attention import relative as truncated_attention
from ropescale.attention.flex import BlockMaskCache, flex_attention_path, region_block_masks
from ropescale.attention.relative import fused_attention, fused_route, naive_attention
from ropescale.strategies.relative import dca, leaky_rerope, rerope, self_extend, string
from tests.conftest import with_cache
from tests.families import family_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

RULES = {"rerope": rerope(8), "leaky_rerope": leaky_rerope(8, 3.0, None, 64), "self_extend": self_extend(3, 8),
         "dca": dca(14, 3, 2.0, False, 16), "string": string(12, 3, None, 64)}
CASES = {  # name: (b, n_h, n_kv, s_q, s_k, pad, options)
    "plain": (1, 4, 4, 40, 40, 0, {}),
    "gqa_left_padding": (2, 6, 2, 40, 40, 7, {}),
    "kv_cache_split": (2, 6, 2, 13, 45, 5, {}),
    "sliding_window": (2, 4, 2, 45, 45, 3, {"sliding_window": 20}),
    "sliding_inside_window": (1, 4, 2, 30, 30, 0, {"sliding_window": 5}),
    "softcap_interleaved": (2, 6, 3, 40, 40, 4, {"softcap": 2.0, "interleaved": True}),
    "per_query_keep": (2, 4, 2, 30, 30, 0, {"per_query": True}),
}
INV = 1.0 / (10000 ** (torch.arange(0, 12, 2).float() / 12))  # 12 of 16 channels rotate


def _case(name, dtype, seed=0):
    """q, k, v (requiring grad), positions and keyword arguments of one case."""
    b, n_h, n_kv, s_q, s_k, pad, opts = CASES[name]
    opts = dict(opts)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_h, s_q, 16, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(b, n_kv, s_k, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    k_pos = torch.arange(s_k, dtype=dtype)[None].repeat(b, 1)  # [b, s_k]
    keep = None
    if pad:  # the last row is left-padded: its positions start after the pad
        k_pos[-1] -= pad
        keep = torch.ones(b, 1, 1, s_k, dtype=torch.bool)
        keep[-1, ..., :pad] = False
    if opts.pop("per_query", False):  # a random per-query mask, some rows all hidden
        keep = torch.rand(b, 1, s_q, s_k, generator=g) > 0.3
        keep[:, :, 3] = False
    args = (q, k, v, k_pos[:, s_k - s_q :], k_pos)
    return args, dict(keep=keep, scale=0.3, **opts)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Let FlexAttention differentiate on the CPU (torch refuses by default) and count its calls."""
    real_validate = torch_flex._validate_device
    monkeypatch.setattr(torch_flex, "_validate_device",
                        lambda q, k, v: real_validate(q.detach(), k.detach(), v.detach()))
    monkeypatch.setattr(flex_regions, "NO_FLEX_BACKWARD", set())
    calls = []
    real_flex = flex_regions.flex_attention

    def counting(*a, **kw):
        calls.append(1)
        return real_flex(*a, **kw)

    monkeypatch.setattr(flex_regions, "flex_attention", counting)
    return calls


def _assert_close_rel(got, want, rtol=1e-5):
    """max |got − want| ≤ rtol · max |want| (entries can be exactly 0: no relative scale of their own)."""
    scale = max(float(w.detach().abs().max()) for w in want)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        err = float((a - b).detach().abs().max())
        assert err <= rtol * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", list(RULES))
def test_flex_equals_oracle_with_gradients(flex_backward_on_cpu, rule, case, dtype):
    args, kw = _case(case, dtype, seed=len(case))
    out = flex_attention_path(*args, RULES[rule], INV, 1.1, **kw)
    ref = naive_attention(*args, RULES[rule], INV, 1.1, **kw).to(dtype)
    assert out.dtype == dtype and 1 <= len(flex_backward_on_cpu) <= len(RULES[rule].regions)  # flex did the work
    _assert_close_rel([out], [ref])
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    q, k, v = args[:3]
    _assert_close_rel(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad))


def test_both_regions_are_flex_calls_and_the_far_one_is_skipped_when_empty(flex_backward_on_cpu):
    args, kw = _case("plain", torch.float32)
    with torch.no_grad():
        flex_attention_path(*args, rerope(8), INV, 1.0, **kw)
        assert len(flex_backward_on_cpu) == 2
        flex_attention_path(*args, rerope(40), INV, 1.0, **kw)  # no pair is 40 apart: near band only
        assert len(flex_backward_on_cpu) == 3


def test_torch_refuses_flex_backward_on_cpu_so_training_uses_fused(monkeypatch):
    """The limitation we work around (if torch lifts it, this test says so), and the fallback:
    with gradients on the CPU the path runs fused_attention, whose gradients equal the oracle's."""
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        torch_flex.flex_attention(q, q, q)
    used = []
    monkeypatch.setattr(flex_regions, "fused_attention", lambda *a, **kw: used.append(1) or fused_attention(*a, **kw))
    args, kw = _case("gqa_left_padding", torch.float32)
    out = flex_attention_path(*args, self_extend(3, 8), INV, 1.0, **kw)
    ref = naive_attention(*args, self_extend(3, 8), INV, 1.0, **kw)
    assert used == [1]
    _assert_close_rel([out], [ref])
    _assert_close_rel(torch.autograd.grad(out.sum(), args[:3]), torch.autograd.grad(ref.sum(), args[:3]))


def test_dropout_goes_to_the_blocked_path(monkeypatch):
    used = []
    monkeypatch.setattr(flex_regions, "blocked_attention", lambda *a, **kw: used.append(kw["dropout"]) or a[0])
    args, kw = _case("plain", torch.float32)
    flex_attention_path(*args, rerope(8), INV, 1.0, dropout=0.1, **kw)
    assert used == [0.1]


def test_fused_on_a_non_cpu_device_dispatches_to_flex(monkeypatch):
    """The "fused" attention path with tensors on another device (meta: shapes only) calls the
    flex path with all its arguments; on the CPU it does not; dropout goes to the blocked path anywhere."""
    assert fused_route("cuda") == "flex" and fused_route("cuda", softcap=30.0) == "flex"
    assert fused_route("cuda", dropout=0.1) == "blocked"
    assert fused_route("cpu") == "regions" and fused_route("cpu", softcap=30.0) == "blocked"
    seen = []
    from ropescale.attention import interface as attention

    monkeypatch.setattr(attention, "flex_attention_path", lambda *a, **kw: seen.append(kw) or "flex ran")
    fused = attention._PATHS["fused"]
    q = torch.empty(1, 4, 10, 16, device="meta")
    pos = torch.arange(10.0, device="meta")[None]
    got = fused(q, q, q, pos, pos, rerope(4), INV, 1.0, scale=0.25, sliding_window=6, softcap=5.0)
    assert got == "flex ran" and seen[0]["sliding_window"] == 6 and seen[0]["softcap"] == 5.0
    args, kw = _case("plain", torch.float32)
    with torch.no_grad():
        assert isinstance(fused(*args, rerope(4), INV, 1.0, **kw), torch.Tensor) and len(seen) == 1
    assert truncated_attention.fused_route is fused_route


def test_block_masks_are_built_once_per_forward_and_rebuilt_when_keep_changes():
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    cache = BlockMaskCache()
    rule = rerope(8)
    first = region_block_masks(2, 30, 30, rule, None, keep, "cpu", cache=cache)
    assert region_block_masks(2, 30, 30, rule, None, keep, "cpu", cache=cache) is first  # another layer, same forward
    assert region_block_masks(2, 30, 30, rule, None, keep, "cpu") is not first  # no cache: built for the call
    keep[1, ..., :4] = False  # changed in place: rebuilt
    second = region_block_masks(2, 30, 30, rule, None, keep, "cpu", cache=cache)
    assert second is not first
    assert region_block_masks(2, 30, 30, rule, None, keep.clone(), "cpu", cache=cache) is not second  # another tensor
    assert region_block_masks(2, 30, 30, rerope(40), None, None, "cpu", cache=cache)[1] is None  # no far region


def test_mask_cache_belongs_to_the_patched_model_not_the_module():
    """No module-level data: each patched model keeps its own masks, gone with its patch."""
    from ropescale.attention import flex as flex_regions
    from ropescale.attention.interface import _TRUNCATION_ATTR

    assert not [n for n, v in vars(flex_regions).items()
                if isinstance(v, (dict, list, BlockMaskCache)) and not n.startswith("__")]
    a, b = family_model("llama"), family_model("llama")
    with torch.no_grad(), ropescale.patch(a, "rerope", window=40, attention_path="flex"), \
            ropescale.patch(b, "rerope", window=40, attention_path="flex"):
        state_a = getattr(a.model.layers[0].self_attn, _TRUNCATION_ATTR)
        state_b = getattr(b.model.layers[0].self_attn, _TRUNCATION_ATTR)
        assert state_a.masks is not state_b.masks
        assert getattr(a.model.layers[1].self_attn, _TRUNCATION_ATTR).masks is state_a.masks  # shared by layers
        a(IDS[:, :60])
        built = state_a.masks.masks
        assert built[0].shape[-2:] == (60, 60)
        assert state_b.masks.masks[0].shape[-2:] != (60, 60)  # b has not run at 60 (only patch's routing check)
        b(IDS[:, :50])
        assert state_a.masks.masks is built  # b's forward did not replace a's masks
    assert not hasattr(a.model.layers[0].self_attn, _TRUNCATION_ATTR)


def test_bad_keep_shape_is_one_clear_value_error():
    args, kw = _case("plain", torch.float32)
    kw["keep"] = torch.ones(1, 40, dtype=torch.bool)
    with torch.no_grad(), pytest.raises(ValueError, match=r"keep must broadcast to \[b, 1, s_q, s_k\]"):
        flex_attention_path(*args, rerope(8), INV, 1.0, **kw)


def test_flex_path_never_reads_tensor_values_on_the_host():
    """Under FakeTensorMode any int()/bool()/if on a tensor value raises (a host sync on a GPU)."""
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
        pos = torch.arange(300).float()[None]
        keep = torch.ones(1, 1, 1, 300, dtype=torch.bool)
        for kw in ({"keep": keep, "sliding_window": 100, "softcap": 5.0}, {}):  # the last one as below
            out = flex_attention_path(q, k, v, pos, pos, self_extend(4, 32), inv, 1.0, scale=0.25, **kw)
            assert out.shape == q.shape
        cache = BlockMaskCache()  # DCA's block structure, built once, and a second call reading new offsets
        for shift in (0.0, 7.0):
            out = flex_attention_path(q, k, v, pos + shift, pos + shift, dca(14, 3, 2.0, False, 16), inv, 1.0,
                                      scale=0.25, masks=cache, positions=pos)
            assert out.shape == q.shape
        with pytest.raises(DataDependentOutputException):
            int(q.sum())
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # real tensors, same shapes: masks not reused
    q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
    pos = torch.arange(300).float()[None]
    with torch.no_grad():
        out = flex_attention_path(q, k, v, pos, pos, self_extend(4, 32), inv, 1.0, scale=0.25)
    torch.testing.assert_close(out, naive_attention(q, k, v, pos, pos, self_extend(4, 32), inv, 1.0, scale=0.25),
                               rtol=0, atol=1e-5)


IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model, strategy, path, ids=IDS, **kw):
    params = {"rerope": {"window": 40}, "leaky_rerope": {"window": 16, "k": 4.0},
              "self_extend": {"window": 16, "group_size": 4}, "dca": {"chunk_size": 24, "local_window": 4},
              "string": {"shifted_offset": 20, "local_window": 3}}[strategy]
    with ropescale.patch(model, strategy, attention_path=path, **params):
        return model(ids, **kw).logits


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: eager, soft-capping, sliding window 32
@pytest.mark.parametrize("strategy", list(RULES))
def test_tiny_model_flex_equals_naive(family, strategy):
    model = family_model(family)
    torch.testing.assert_close(_logits(model, strategy, "flex"), _logits(model, strategy, "naive"), rtol=0, atol=1e-5)


def test_tiny_llama_left_padding_and_cached_decoding_with_flex():
    model = family_model("llama")
    mask = torch.ones_like(IDS[:, :80])
    mask[1, :12] = 0
    kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    torch.testing.assert_close(_logits(model, "leaky_rerope", "flex", IDS[:, :80], **kw),
                               _logits(model, "leaky_rerope", "naive", IDS[:, :80], **kw), rtol=0, atol=1e-5)
    with torch.no_grad(), ropescale.patch(model, "self_extend", window=16, group_size=4, attention_path="flex"):
        cache = DynamicCache(config=model.config)
        model(IDS[:, :70], **with_cache(cache), use_cache=True)
        for t in range(70, 75):
            step = model(IDS[:, t : t + 1], **with_cache(cache), use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, model(IDS[:, : t + 1]).logits[:, -1], rtol=0, atol=1e-5)


def test_block_masks_are_built_compiled_on_cuda():
    """Eager create_block_mask evaluates all s_q × s_k pairs at once; on CUDA it must be compiled
    (checked without a GPU: the builder chosen for a CUDA device is not the eager function)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ropescale.attention.flex import _mask_builder

    assert _mask_builder(torch.device("cpu")) is create_block_mask
    cuda = _mask_builder(torch.device("cuda"))
    assert cuda is not create_block_mask and cuda is _mask_builder(torch.device("cuda"))  # compiled once


@pytest.mark.parametrize("strategy,params", [("dca", {"chunk_size": 24, "local_window": 4}), ("rerope", {"window": 8})])
def test_masks_are_built_once_per_shape_for_chunk_rules_too(monkeypatch, strategy, params):
    """The layers of a forward share their masks, and a steady-state forward builds none: distance rules'
    masks depend on shapes alone, chunk rules' block lists are built to hold for every row offset, and each
    call reads its own offsets inside the mask (``test_chunk_structure_equals_the_oracle_for_any_offsets``)."""
    from ropescale.attention import flex as flex_regions

    built = []  # create_block_mask calls (distance regions) and chunk structures built (all a chunk rule's regions)
    real, real_structure = flex_regions.create_block_mask, flex_regions._chunk_structure
    monkeypatch.setattr(flex_regions, "create_block_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    monkeypatch.setattr(flex_regions, "_chunk_structure", lambda *a, **kw: built.append(1) or real_structure(*a, **kw))
    model = family_model("llama")
    assert model.config.num_hidden_layers > 1
    regions = len(ropescale.strategies.get_strategy(strategy).compute(
        {"original_max_position_embeddings": 32}, ropescale.strategies.get_strategy(strategy).validate(params)).regions)
    with torch.no_grad(), ropescale.patch(model, strategy, attention_path="flex", **params):
        before = len(built)  # patch() probes the routing with a forward of its own
        first = model(IDS[:, :60]).logits
        assert len(built) - before == (1 if strategy == "dca" else regions)  # not regions × layers
        again = model(IDS[:, :60], position_ids=torch.arange(60)[None]).logits  # a new position_ids tensor
        assert len(built) - before == (1 if strategy == "dca" else regions)  # a steady-state forward builds none
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("rule", [dca(14, 3, 2.0, False, 16), dca(20, 4, 1.0, True, 16), dca(32, 5, 1.0, False, 16)])
def test_chunk_structure_equals_the_oracle_for_any_offsets(rule):
    """The block lists built once (``_chunk_structure``: blocks of 128, so 300 tokens have full, partial and
    cut blocks) serve calls with any row offsets — rows starting 0, 37, 5 and 129 positions late, a
    KV-cache split and a sliding window — each equal to the naive oracle, and none builds again."""
    g = torch.Generator().manual_seed(3)
    cache = BlockMaskCache()
    for s_q, s_k, shifts, window in ((300, 300, (0, 37), None), (300, 300, (5, 129), None),
                                     (100, 300, (0, 61), None), (300, 300, (11, 0), 200)):
        q = torch.randn(2, 4, s_q, 16, generator=g)
        k, v = (torch.randn(2, 2, s_k, 16, generator=g) for _ in range(2))
        k_pos = torch.arange(s_k, dtype=torch.float32)[None] + torch.tensor(shifts, dtype=torch.float32)[:, None]
        q_pos = k_pos[:, s_k - s_q:]
        kw = {"scale": 0.3, "sliding_window": window}
        with torch.no_grad():
            out = flex_attention_path(q, k, v, q_pos, k_pos, rule, INV, 1.0, masks=cache, positions=k_pos, **kw)
        _assert_close_rel([out], [naive_attention(q, k, v, q_pos, k_pos, rule, INV, 1.0, **kw)])
    assert cache.builds == 3  # one structure per (lengths, window): the second call with new offsets built none


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The CUDA configuration on the CPU: the path decides compiled or eager as on CUDA
    (``flex_regions._compiles`` with the device taken for CUDA), ``torch.compile`` through
    ``flex_regions._compiled`` with a backend that counts dynamo's compilations per function and
    then runs the captured graph eagerly (the CPU inductor kernel has no LSE), and dynamo's
    recompile limit made a hard error instead of its silent fall-back to the eager, unfused
    function."""
    import torch._dynamo

    counts = {"create_block_mask": 0, "flex_attention": 0}

    def counting(name):
        def backend(gm, example_inputs):
            counts[name] += 1
            return gm.forward
        return backend

    backends = {torch_flex.create_block_mask: counting("create_block_mask"),
                torch_flex.flex_attention: counting("flex_attention")}
    real_compiled, real_compiles = flex_regions._compiled, flex_regions._compiles
    monkeypatch.setattr(flex_regions, "_compiled", lambda fn, backend="inductor": real_compiled(fn, backends[fn]))
    monkeypatch.setattr(flex_regions, "_compiles", lambda device, scores: real_compiles(torch.device("cuda"), scores))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield counts
    torch._dynamo.reset()


def test_compiled_path_compiles_once_for_every_region_rule_window_and_cache_offset(compiled_on_cpu, monkeypatch):
    """Regions, rules, windows and cache offsets differ only in numbers, which the mask carries as
    tensors: once the shapes have been compiled, another region or rule compiles nothing (a number
    in the mask's closure is a dynamo guard: one compilation each, and past the recompile limit
    torch silently runs the eager, unfused kernel on the GPU). The masks are built without
    autograd, so a forward with gradients compiles no new builder. Outputs equal the oracle's
    (the numbers are read when the kernel runs, not baked into the first compilation)."""
    monkeypatch.setattr(flex_regions, "EAGER_SCORES", 0)  # these small inputs take the compiled path
    rules = [rerope(8), leaky_rerope(12, 3.0, None, 64), self_extend(3, 10), string(12, 3, None, 64), rerope(20)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 40, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    pos = torch.arange(40.0)[None]
    shapes = [(q, k, v, pos, pos), (q[:, :, -13:], k, v, pos[:, -13:], pos),  # a forward; a KV-cache split
              (q[:, :, -12:], k, v, pos[:, -12:], pos)]  # the next step of it (another c0)
    with torch.no_grad():
        for args in shapes:  # compile each shape kind once
            flex_attention_path(*args, rules[0], INV, 1.0, scale=0.3)
        warm = dict(compiled_on_cpu)
        for rule in rules[1:]:
            for args in shapes:
                out = flex_attention_path(*args, rule, INV, 1.0, scale=0.3)
                _assert_close_rel([out], [naive_attention(*args, rule, INV, 1.0, scale=0.3)])
        assert compiled_on_cpu == warm
    with torch.enable_grad():  # a training forward builds its masks as inference does
        flex_attention_path(*shapes[0], rules[1], INV, 1.0, scale=0.3)
    assert compiled_on_cpu["create_block_mask"] == warm["create_block_mask"]


def test_compiled_chunk_rule_shares_its_graph_across_regions_and_offsets(compiled_on_cpu, monkeypatch):
    """DCA's three chunk regions, other chunk sizes and other row offsets (left padding) reuse one
    compiled mask builder and kernel per shape; the outputs equal the oracle's."""
    monkeypatch.setattr(flex_regions, "EAGER_SCORES", 0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 48, 16, generator=g)
    k, v = (torch.randn(2, 2, 48, 16, generator=g) for _ in range(2))
    pos = torch.arange(48.0)[None].repeat(2, 1)
    with torch.no_grad():
        flex_attention_path(q, k, v, pos, pos, dca(14, 3, 2.0, False, 16), INV, 1.0, scale=0.3)
        warm = dict(compiled_on_cpu)
        for rule, shift in ((dca(14, 3, 2.0, False, 16), 5), (dca(20, 4, 1.0, False, 16), 0),
                            (dca(9, 2, 1.0, True, 16), 3)):
            p = pos - torch.tensor([[0.0], [shift]])  # row 1 starts `shift` positions earlier
            out = flex_attention_path(q, k, v, p, p, rule, INV, 1.0, scale=0.3)
            _assert_close_rel([out], [naive_attention(q, k, v, p, p, rule, INV, 1.0, scale=0.3)])
    assert compiled_on_cpu == warm


def test_small_inputs_run_eagerly_where_the_path_compiles(compiled_on_cpu, monkeypatch):
    """The patch's 2-token routing check and inputs of at most EAGER_SCORES scores compile nothing
    (each would be a compilation and a dynamo cache entry of its own), without torch's warning
    about eager FlexAttention; above it the compiled functions run. Both give the oracle's
    outputs."""
    model = family_model("llama")
    monkeypatch.setattr(torch_flex, "_WARNINGS_SHOWN", set())  # torch warns once per process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad(), ropescale.patch(model, "rerope", window=8, attention_path="flex"):
            model(IDS[:, :5])
    assert compiled_on_cpu == {"create_block_mask": 0, "flex_attention": 0}
    # eager on purpose: torch's warning about calling it uncompiled is not shown
    assert not [w for w in seen if "without torch.compile" in str(w.message)]
    args, kw = _case("plain", torch.float32)  # b·n_h·s_q·s_k = 1·4·40·40 = 6400
    args = tuple(a.detach() for a in args)
    with torch.no_grad():
        out = flex_attention_path(*args, rerope(8), INV, 1.0, **kw)
        assert compiled_on_cpu == {"create_block_mask": 0, "flex_attention": 0}
        monkeypatch.setattr(flex_regions, "EAGER_SCORES", 6399)
        compiled = flex_attention_path(*args, rerope(8), INV, 1.0, **kw)
    assert compiled_on_cpu["create_block_mask"] >= 1 and compiled_on_cpu["flex_attention"] >= 1
    ref = naive_attention(*args, rerope(8), INV, 1.0, **kw)
    _assert_close_rel([out, compiled], [ref, ref])
