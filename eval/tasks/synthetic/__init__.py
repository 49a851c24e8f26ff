"""Synthetic long-context tasks past needles, generated offline and scored from greedy generations as the RULER
family is (``eval.tasks.ruler``): HELMET's JSON key-value retrieval (``json_kv``) and OpenAI's GraphWalks
(``graphwalks``).

``base`` (what both share: the options every such task has, the sample cache, batched greedy decoding, requests to
a scoring engine, the sizing of a sample to L tokens), one generator module per task (``json_kv_gen``,
``graphwalks_gen``: the format, written from the sources each names) and one task module each (``json_kv``,
``graphwalks``: the options, the metric, the task). The task registry finds them here like any other task module.
"""
