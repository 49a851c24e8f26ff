"""KL(P_unpatched ‖ P_patched) beside the NLL (``window_nll(kl=True)``), against an independent
computation: a deep copy of the model that is never patched, full logits in float64, the sum
Σ_v p(v) (log p(v) − log q(v)) written out per position. Agreement: 1e-3 relative or 1e-7 nats
absolute (the code under test works in float32: log-probabilities of a few nats carry ~1e-7
rounding, and the KL of these tiny models is 1e-5–1e-3 nats per token)."""

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import ropescale
from ropescale.runs.scoring import score_windows, window_nll
from ropescale.runs.windows import make_windows
from tests.conftest import build, tiny_gemma3_config

close = partial(math.isclose, rel_tol=1e-3, abs_tol=1e-7)


def _sharp(model):
    """A random model's next-token distributions are nearly uniform (KL ~ 1e-7 whatever the patch):
    a larger head makes them peaked, as a trained model's are."""
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def _docs():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g) for n in (150, 90)]


@torch.no_grad()
def kl_oracle(unpatched, patched, docs, windows, *, bos=None, first=0):
    """(Σ KL, scored tokens, Σ KL over predictions 1..first, their count), window by window."""
    total = count = total_first = count_first = 0.0
    for w in windows:
        ids = docs[w.doc][w.start : w.end].tolist()
        offset = 0
        if bos is not None:
            ids, offset = [bos] + ids, 1
        x = torch.tensor([ids])
        p = F.log_softmax(unpatched(x).logits[0].double(), -1)  # [n, V]
        q = F.log_softmax(patched(x).logits[0].double(), -1)
        for j in range(1, len(ids)):  # target j, predicted at j - 1
            if w.start + j - offset < w.score_from:
                continue
            kl = float((p[j - 1].exp() * (p[j - 1] - q[j - 1])).sum())
            total, count = total + kl, count + 1
            if j <= first:
                total_first, count_first = total_first + kl, count_first + 1
    return total, count, total_first, count_first


@pytest.mark.parametrize(("strategy", "params"), [("yarn", {"factor": 4}), ("rerope", {"window": 8}),
                                                  ("dynamic_ntk", {})])
def test_kl_equals_the_written_out_sum_over_an_unpatched_copy(tiny_llama, strategy, params):
    docs = _docs()
    _sharp(tiny_llama)
    unpatched = copy.deepcopy(tiny_llama)
    windows = make_windows([len(d) for d in docs], 96, "sliding", stride=40, bos=True)
    with ropescale.patch(tiny_llama, strategy, original_max_position_embeddings=32, **params):
        s = score_windows(tiny_llama, docs, windows, length=96, bos_token_id=5, batch_size=2, buckets=4, kl=True,
                          kl_first=20)
        total, count, total_first, count_first = kl_oracle(unpatched, tiny_llama, docs, windows, bos=5, first=20)
        assert ropescale.current_patch(tiny_llama).active  # the patch is back after every window
    assert s.tokens == count and total / count > 1e-5  # the strategy moved the distributions
    assert close(s.mean_kl, total / count)
    assert s.kl_first[1] == count_first and close(s.mean_kl_first, total_first / count_first)
    rows = s.by_position()
    assert math.isclose(sum(r["kl"] * r["tokens"] for r in rows if r["tokens"]), s.mean_kl * s.tokens, rel_tol=1e-9)
    assert all(r["kl"] >= 0 for r in rows)


def test_kl_is_zero_for_vanilla_and_without_a_patch(tiny_llama):
    docs = _docs()
    windows = make_windows([len(d) for d in docs], 64)
    bare = score_windows(tiny_llama, docs, windows, length=64, kl=True)
    assert bare.mean_kl == 0.0
    with ropescale.patch(tiny_llama, "vanilla"):
        same = score_windows(tiny_llama, docs, windows, length=64, kl=True)
    assert same.mean_kl == 0.0 and same.nll == bare.nll


def test_kl_through_full_logits_equals_the_chunked_head(tiny_llama, monkeypatch):
    """A head ropescale cannot reproduce is scored from full [n, V] logits: the same KL."""
    import ropescale.runs.scoring as scoring

    docs = _docs()
    _sharp(tiny_llama)
    windows = make_windows([len(d) for d in docs], 64)
    with ropescale.patch(tiny_llama, "yarn", factor=2, original_max_position_embeddings=32):
        chunked = score_windows(tiny_llama, docs, windows, length=64, kl=True, logits_chunk=7)

        def no_head(model):
            raise ValueError("no separate head")

        monkeypatch.setattr(scoring, "OutputHead", no_head)
        full = score_windows(tiny_llama, docs, windows, length=64, kl=True)
    assert chunked.mean_kl > 1e-5 and close(full.mean_kl, chunked.mean_kl)


def test_blockwise_kl_follows_the_prefix_forwards(tiny_llama):
    """With ``prefix_block`` the patched and the unpatched distributions both come from the
    forward over the prefix ending at the block."""
    docs = _docs()
    _sharp(tiny_llama)
    unpatched = copy.deepcopy(tiny_llama)
    windows = make_windows([len(d) for d in docs], 90)[:1]
    ids = docs[0][:90]
    with ropescale.patch(tiny_llama, "dynamic_ntk", original_max_position_embeddings=32):
        (part,) = window_nll(tiny_llama, docs, windows, length=90, buckets=1, prefix_block=30, kl=True)
        want = 0.0
        with torch.no_grad():
            for end, start in ((30, 1), (60, 30), (90, 60)):
                p = F.log_softmax(unpatched(ids[None, :end]).logits[0].double(), -1)
                q = F.log_softmax(tiny_llama(ids[None, :end]).logits[0].double(), -1)
                want += float((p.exp() * (p - q)).sum(-1)[start - 1 : end - 1].sum())
    assert want > 1e-3 and close(float(part[2].sum()), want)


def test_parts_with_and_without_kl_do_not_mix(tiny_llama):
    from ropescale.runs.scoring import combine_windows

    docs = _docs()
    windows = make_windows([len(d) for d in docs], 64)
    plain = window_nll(tiny_llama, docs, windows, length=64, buckets=2)
    with_kl = window_nll(tiny_llama, docs, windows, length=64, buckets=2, kl=True)
    with pytest.raises(ValueError, match="with and without KL"):
        combine_windows(plain[:1] + with_kl[1:], 64, 2)


# --- PatchHandle.suspended: the unpatched model inside, the same patch after -----------------------

@torch.no_grad()
@pytest.mark.parametrize(("family", "strategy", "params"), [
    ("llama", "yarn", {"factor": 4, "original_max_position_embeddings": 32}),
    ("llama", "self_extend", {"group_size": 4, "window": 8, "logn": True}),
    ("llama", "dynamic_ntk", {"original_max_position_embeddings": 16, "temperature": "llama4"}),
    ("gemma3", "linear", {"factor": 2}),  # per layer type: the global layer only
])
def test_suspended_gives_the_unpatched_model_then_the_same_patch(tiny_llama, family, strategy, params):
    if family == "llama":
        model = tiny_llama
    else:
        from transformers import Gemma3ForCausalLM

        model = build(Gemma3ForCausalLM, tiny_gemma3_config())
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    bare = model(ids).logits
    handle = ropescale.patch(model, strategy, **params)
    patched = model(ids).logits
    report = handle.report()
    assert not torch.equal(patched, bare)
    with handle.suspended() as inside:
        assert inside is model and ropescale.current_patch(model) is None
        assert torch.equal(model(ids).logits, bare)
    assert ropescale.current_patch(model) is handle and handle.active
    assert torch.equal(model(ids).logits, patched) and handle.report() == report
    handle.unpatch()
    assert torch.equal(model(ids).logits, bare) and ropescale.current_patch(model) is None
    with pytest.raises(RuntimeError, match="undone"), handle.suspended():
        pass


def test_suspended_keeps_the_training_length(tiny_llama):
    handle = ropescale.patch(tiny_llama, "dynamic_ntk", original_max_position_embeddings=16)
    handle.train_at(64)
    with handle.suspended():
        pass
    assert [f.target_length for f in handle._frequencies] == [64]
    handle.unpatch()
