"""LongRoPE2's needle-driven objective (Shang et al. 2025, arXiv:2502.20082, §3: "needle-driven"
perplexity): the model's loss on the *answer tokens* of long documents with planted needles, so a
search rewards rescalings under which the long context is actually used, not only those that keep
the average token's loss low (most tokens of a long document need no long context).

Documents: the search split's own text (``needle_trials`` prompts at the longest target length), a
needle "One of the special magic numbers for {word} is: {number}." at depths spread over [0, 1],
RULER's question at the end (``eval.tasks.needle``: real text as the haystack, the needle the one
odd line); seed ``NEEDLE_SEED``, not the needle eval's 0, so the searched prompts are not the
reported ones. The term is the mean NLL per answer token [nats], one full forward per prompt over
prompt + answer; ``needle_weight`` × it is added to the objective (``eval.search.objective``),
beside the perplexity terms and the passkey term.
"""

from __future__ import annotations

import torch

__all__ = ["NEEDLE_SEED", "answer_nll", "needle_examples"]

NEEDLE_SEED = 104729  # needle words and numbers of the search; the needle eval's default seed is 0


def needle_examples(tokenizer, docs: list[torch.Tensor], *, length: int, trials: int, train_length: int) -> list:
    """``trials`` needle prompts of ``length`` tokens (answer included) over ``docs``
    (``eval.tasks.retrieval.Example``: prompt ids ``[n]``, answer ids first among the candidates)."""
    from ..tasks.needle import Needle, NeedleOptions

    depths = [i / (trials - 1) for i in range(trials)] if trials > 1 else [0.5]
    options = NeedleOptions(depths=depths, trials=1, candidates=2, seed=NEEDLE_SEED)
    task = Needle(options, tokenizer=tokenizer, train_length=train_length, documents=docs, source="the search split")
    return task.examples(length)


@torch.no_grad()
def answer_nll(model, examples: list, device) -> float:
    """Mean NLL per answer token [nats] of ``examples``' answers after their prompts."""
    total, tokens = 0.0, 0
    for ex in examples:
        prompt, answer = ex.prompt.ids, ex.candidates[0]
        ids = torch.tensor([prompt + answer], device=device)  # [1, n + a]
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer) + 1).logits[0, :-1]  # [a, V]
        logp = logits.double().log_softmax(-1).gather(-1, ids[0, len(prompt):, None])
        total -= float(logp.sum())
        tokens += len(answer)
    return total / tokens
