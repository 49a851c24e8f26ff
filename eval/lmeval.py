"""Run any lm-evaluation-harness task on a ropescale-patched model.

Registers the model type ``ropescale`` with lm-eval (``pip install "ropescale[lm-eval]"``): an
``HFLM`` whose model is loaded with ``ropescale.load_model`` (bundled names, local paths, hub
ids) and patched with ``ropescale.patch``. ``model_args`` take the strategy, its parameters and
the patch options next to lm-eval's own ``HFLM`` arguments::

    ropescale lm-eval --model ropescale \\
        --model_args pretrained=reference,strategy=yarn,factor=8 --tasks TASK ...
    python -m eval.lmeval ...            # the same, without the ropescale CLI

lm-eval 0.4.13 finds models only in its own registry (it has no plugin entry points), so the
``ropescale`` model exists once this module is imported: the commands above import it and then
hand the arguments to lm-eval's own CLI unchanged; from Python, ``import eval.lmeval`` before
``lm_eval.simple_evaluate(model="ropescale", ...)``.

``max_length`` (lm-eval's context window for rolling perplexity and truncation) defaults to
``factor × L_train`` when the strategy has a ``factor``, else to the model's own window.
Raises ``ValueError`` for an unknown strategy or parameter, as ``ropescale.patch`` does.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import ropescale
from ropescale.strategies import get_strategy

__all__ = ["RopescaleLM", "main"]

_PATCH_OPTIONS = ("original_max_position_embeddings", "layer_types", "dynamic_cache", "dynamic_block", "logn")


@register_model("ropescale")
class RopescaleLM(HFLM):
    """lm-eval's ``HFLM`` over a model loaded and patched by ropescale."""

    def __init__(self, pretrained: str, strategy: str = "vanilla", dtype: str = "float32", device: str = "cpu",
                 max_length: int | None = None, **kwargs: Any):
        strat = get_strategy(strategy)
        names = {p.name for p in strat.params}
        params = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _PATCH_OPTIONS}
        if isinstance(options.get("layer_types"), str):
            options["layer_types"] = options["layer_types"].split("|")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI asks for cuda by default; its own HFLM falls back to the CPU too
            logging.getLogger(__name__).warning("device %s is not available; running on the CPU", device)
            device = "cpu"
        model, tokenizer = ropescale.load_model(str(pretrained), dtype=dtype, device=str(device))
        ropescale.unpatch(model)  # a saved patch would stack under this one
        handle = ropescale.patch(model, strategy, **options, **params)
        if max_length is None and "factor" in handle.params:
            max_length = int(handle.params["factor"] * handle.context["original_max_position_embeddings"])
        self.patch_handle = handle
        super().__init__(pretrained=model, tokenizer=tokenizer, max_length=max_length, device=device, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``ropescale`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
