"""ropescale's evaluation harness (installed as ``ropescale_eval``): experiments that run
evaluation tasks (``tasks/``) over strategies × lengths (``sweep``), their configs, reports and
figures, fine-tuning with ``eval.after`` experiments (``finetune``), run comparison
(``compare``), the rotary-geometry tool (``inspect``), the lm-eval bridge (``lmeval``) and the
reference model's recipe (``reference/``). It imports the library ``ropescale``; the library
never imports it."""
