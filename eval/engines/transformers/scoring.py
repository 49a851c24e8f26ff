"""``engine: transformers``, the default: the patched model in this process measures every task itself
(``Task.measure``; ``eval.sweep``, ``eval.search.objective``) — each process its share under
``accelerate launch``."""

from __future__ import annotations

from ..scoring import ScoringEngine

__all__ = ["TransformersScoring"]


class TransformersScoring(ScoringEngine):
    """The patched model in this process (``eval.sweep``'s own measuring)."""

    name = "transformers"
    answers = frozenset({"logprobs", "generate"})
    in_process = True

    def version(self) -> str:
        import transformers

        return transformers.__version__
