"""Fine-tune a patched model at the target length: ``ropescale finetune CONFIG.yaml``.

- ``config``: ``FinetuneConfig`` (YAML / ``--set``), ``resolve`` (what depends on the model's T)
- ``pose``: PoSE position ids (Zhu et al. 2024, arXiv:2309.10400; the authors' sampling by default)
- ``data``: training windows in a seeded order (PoSE examples drawn per index)
- ``heldout``: held-out perplexity during training
- ``run``: the fine-tuning run (``finetune``) through the one run protocol; ``parallel``: its parallel layout
- ``loop``: the accelerate training loop, checkpoints and the saved model
- ``checkpoints``: checkpoint folders, their completion markers, a full disk in one line
- ``recipes``: what trains and how it is saved, one module each (``full``, ``lora``, ``longlora``)
- ``lora``: LoRA / LongLoRA's LoRA+ through PEFT, saved merged or as an adapter
- ``report``: the training log and its figure (comparing runs: ``eval.compare``)
"""

from ropescale.training.config import FinetuneConfig, ResolvedRun, build_finetune_config, load_finetune_config, resolve
from ropescale.training.pose import sample_pose
from ropescale.training.run import finetune

__all__ = ["FinetuneConfig", "ResolvedRun", "build_finetune_config", "finetune", "load_finetune_config", "resolve",
           "sample_pose"]
