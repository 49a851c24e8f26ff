import math

import torch
import torch.nn.functional as F

from ropescale.runs.scoring import score_windows
from ropescale.runs.windows import make_windows


@torch.no_grad()
def plain_loop_nll(model, docs, windows, bos=None):
    """The textbook loop: one window at a time, sum -log p(token | context) by hand."""
    total, count = 0.0, 0
    for w in windows:
        ids = docs[w.doc][w.start : w.end].tolist()
        offset = 0
        if bos is not None:
            ids, offset = [bos] + ids, 1
        logp = F.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        for j in range(1, len(ids)):
            if w.start + j - offset >= w.score_from:
                total -= logp[j - 1, ids[j]].item()
                count += 1
    return total, count


def docs_for_test():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g) for n in (150, 37, 90)]


def test_chunk_matches_plain_loop(tiny_llama):
    docs = docs_for_test()
    windows = make_windows([len(d) for d in docs], 32)
    s = score_windows(tiny_llama, docs, windows, length=32, batch_size=3)
    total, count = plain_loop_nll(tiny_llama, docs, windows)
    assert s.tokens == count == len(windows) * 31
    assert math.isclose(s.nll, total, rel_tol=1e-6)


def test_sliding_with_bos_matches_plain_loop(tiny_llama):
    docs = docs_for_test()
    windows = make_windows([len(d) for d in docs], 40, "sliding", stride=16, bos=True)
    s = score_windows(tiny_llama, docs, windows, length=40, bos_token_id=5, batch_size=2)
    total, count = plain_loop_nll(tiny_llama, docs, windows, bos=5)
    assert s.tokens == count == sum(len(d) for d in docs)  # with BOS every token is scored once
    assert math.isclose(s.nll, total, rel_tol=1e-6)


def test_position_buckets_partition_the_scored_tokens(tiny_llama):
    docs = docs_for_test()
    windows = make_windows([len(d) for d in docs], 64)
    s = score_windows(tiny_llama, docs, windows, length=64, buckets=4)
    rows = s.by_position()
    assert [(r["start"], r["end"]) for r in rows] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert [r["tokens"] for r in rows] == [15 * len(windows)] + [16 * len(windows)] * 3
    assert math.isclose(sum(r["nll"] * r["tokens"] for r in rows), s.nll, rel_tol=1e-9)


def test_blockwise_scoring_equals_prefix_forwards(tiny_llama):
    """Oracle: each block's targets come from a forward over exactly the prefix ending there."""
    import ropescale

    docs = docs_for_test()
    windows = make_windows([len(d) for d in docs], 100)[:1]
    with ropescale.patch(tiny_llama, "dynamic_ntk"):
        s = score_windows(tiny_llama, docs, windows, length=100, prefix_block=30)
        ids = docs[0][:100]
        total = 0.0
        with torch.no_grad():
            for end, start in ((30, 1), (60, 30), (90, 60), (100, 90)):
                logp = F.log_softmax(tiny_llama(ids[None, :end]).logits[0].double(), -1)
                total -= sum(logp[j - 1, ids[j]].item() for j in range(start, end))
        single = score_windows(tiny_llama, docs, windows, length=100)
    assert s.tokens == 99 and math.isclose(s.nll, total, rel_tol=1e-6)
    assert s.nll != single.nll  # the semantics differ past L_train (slightly, on a random model)
    assert math.isclose(score_windows(tiny_llama, docs, windows, length=100, prefix_block=30).nll,
                        score_windows(tiny_llama, docs, windows, length=100).nll, rel_tol=1e-7)  # static
    # (float32 forwards over prefixes of other lengths round differently: 1.7e-9 relative seen on a 2-core x86 CPU)


def test_logits_chunk_is_an_option_outside_the_identity(tiny_llama):
    from eval.tasks.perplexity import PerplexityOptions

    assert PerplexityOptions(logits_chunk=3).key() == PerplexityOptions().key()
    docs = docs_for_test()
    windows = make_windows([len(d) for d in docs], 40)
    small = score_windows(tiny_llama, docs, windows, length=40, logits_chunk=3)
    total, count = plain_loop_nll(tiny_llama, docs, windows)
    assert small.tokens == count and math.isclose(small.nll, total, rel_tol=1e-6)


def test_token_nll_equals_full_logits_token_by_token(tiny_llama):
    from ropescale.runs.scoring import token_nll

    ids = docs_for_test()[0][:60]
    with torch.no_grad():
        logp = F.log_softmax(tiny_llama(ids[None]).logits[0].double(), -1)  # [n, V], by hand
    want = -logp[:-1].gather(-1, ids[1:, None])[:, 0]
    got = token_nll(tiny_llama, ids, chunk=7)  # chunks that do not divide n
    assert got.dtype == torch.float64 and got.shape == (59,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
