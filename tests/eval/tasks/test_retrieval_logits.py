"""The retrieval tasks keep only the logits they use (``logits_to_keep``): on the bundled model
every example scores exactly as with full-sequence logits (the scoring main had)."""

import pytest
import torch

from eval.tasks.base import get_task
from ropescale.compat import output_cache
from ropescale.models import load_model
from ropescale.strategies import get_strategy


class FullLogits(torch.nn.Module):
    """The same model computing the head over every position (``[b, n, V]``, as main did), then
    keeping the last ``logits_to_keep`` positions by slicing."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, *args, logits_to_keep=0, **kwargs):
        out = self.inner(*args, **kwargs)
        assert out.logits.shape[1] == kwargs["input_ids"].shape[1]  # really the full sequence
        if logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out


@pytest.mark.slow
@pytest.mark.parametrize("task,strategy,length", [("passkey", "vanilla", 128), ("needle", "dynamic_ntk", 256)])
def test_retrieval_rows_equal_full_logit_scoring(task, strategy, length):
    import ropescale

    model, tok = load_model("reference", device="cpu")
    cls = get_task(task)
    opts = cls.Options(depths=[0.0, 0.5, 1.0], trials=2)
    kw = {"documents": None}
    if cls.uses_data:
        from ropescale.runs.data import DataSpec, load_documents, tokenize_documents

        kw["documents"] = tokenize_documents(tok, load_documents(DataSpec("kjv-heldout")))
    t = cls(opts, tokenizer=tok, train_length=128, **kw)
    examples = t.examples(length)
    idx = list(range(len(examples)))
    with ropescale.patch(model, strategy):
        s = get_strategy(strategy)
        kept = t.measure(model, examples, idx, length=length, strategy=s, device=torch.device("cpu"), desc=None)
        full = t.measure(FullLogits(model), examples, idx, length=length, strategy=s, device=torch.device("cpu"),
                         desc=None)
    assert kept == full
    assert any(cand for _, _, cand in full)  # rows that can differ: some examples are found


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # plain cache (crop) / sliding-window cache (copy)
def test_cached_candidates_leave_the_prompt_cache_as_it_was(family):
    from eval.tasks.retrieval import _candidate_scores_cached, _rewindable
    from tests.families import family_model

    model = family_model(family)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, 40), generator=g)  # past Gemma 2's sliding window (32)
    candidates = [torch.randint(0, 256, (k,), generator=g).tolist() for k in (3, 1, 4, 3)]
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        assert _rewindable(output_cache(out)) == (family == "llama")
        before = [(layer.keys.clone(), layer.values.clone()) for layer in output_cache(out).layers]
        last = out.logits[0, -1].float().log_softmax(-1)
        scores = _candidate_scores_cached(model, last, output_cache(out), candidates, "cpu")
        for layer, (k, v) in zip(output_cache(out).layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        for score, c in zip(scores, candidates):  # oracle: one full forward over prompt + candidate
            ids = torch.cat([prompt, torch.tensor([c])], 1)
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
            want = sum(float(logp[39 + j, t]) for j, t in enumerate(c))
            assert float(score) == pytest.approx(want, abs=1e-4)


class CountingModel(torch.nn.Module):
    """The model, counting the tokens each forward runs over."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.tokens = model, 0

    def forward(self, *args, **kwargs):
        self.tokens += kwargs["input_ids"].shape[1]
        return self.inner(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["vanilla", "yarn:factor=2", "rerope", "self_extend", "dca"])
def test_prompts_sharing_a_prefix_score_as_whole_prompts(strategy, monkeypatch):
    """``PrefixCache``: passkey prompts at several depths share the filler before their needles; run on one
    cache cropped back to each shared prefix, every prompt's last log-probabilities equal a forward over the
    whole prompt (float noise), the rows equal whole-prompt scoring, and far fewer tokens run."""
    import eval.tasks.retrieval as retrieval
    import ropescale
    from ropescale.runs.config import parse_strategy

    model, tok = load_model("reference", device="cpu")
    cls = get_task("passkey")
    t = cls(cls.Options(depths=[0.1, 0.5, 0.9], trials=2), tokenizer=tok, train_length=128, documents=None)
    examples = t.examples(256)
    idx = list(range(len(examples)))
    spec = parse_strategy(strategy)
    cpu = torch.device("cpu")
    with ropescale.patch(model, spec.name, **spec.params):
        s = get_strategy(spec.name)
        shared, whole = retrieval.PrefixCache(model, cpu, share=True), retrieval.PrefixCache(model, cpu, share=False)
        for i in shared.order([examples[i].prompt.ids for i in idx], idx):
            got, _ = shared.run(examples[i].prompt.ids)
            want, _ = whole.run(examples[i].prompt.ids)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
        counting = CountingModel(model)
        rows = t.measure(counting, examples, idx, length=256, strategy=s, device=cpu, desc=None)
        reused, counting.tokens = counting.tokens, 0

        class Whole(retrieval.PrefixCache):
            def __init__(self, model, device, *, share):
                super().__init__(model, device, share=False)

        monkeypatch.setattr(retrieval, "PrefixCache", Whole)
        plain = t.measure(counting, examples, idx, length=256, strategy=s, device=cpu, desc=None)
    assert sorted(rows) == sorted(plain)
    prompts = sum(len(ex.prompt.ids) for ex in examples)
    assert counting.tokens - reused > 0.3 * prompts  # the filler before the needles ran once, not six times
