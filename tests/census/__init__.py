"""The architecture census (issue 27, item 1): every causal-LM type of the installed transformers,
built tiny from its config class, checked against every kind of ropescale strategy.

- ``catalog``: the types (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``);
- ``build``: the tiny builder and its per-family overrides;
- ``probe``: ground truth from the model itself (which layers rotate; a layer on identical inputs);
- ``checks``: the checks of one type, each ending exact / refused / crash / wrong / n/a;
- ``run``: the census, computed once per process;
- ``known``: what fails today, by cause (strict xfails of ``tests/test_census.py``);
- ``report``: the supported-architectures page (``python -m tests.census.report``).
"""
