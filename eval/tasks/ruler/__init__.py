"""RULER (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER): its 13 tasks as one family of modules.

``base`` (the family's task class: RULER's samples, cached and scored), ``spec`` (templates, metrics,
the sample record), ``text`` (haystacks and word lists), ``cache``; one generator per RULER script
(``niah_gen``, ``vt_gen``, ``cwe_gen``, ``fwe_gen``, ``qa_gen``, checked sample for sample against RULER's
own output) and one task module each (``niah``, ``vt``, ``cwe``, ``fwe``, ``qa``), plus ``suite`` (all 13
and the effective length). The task registry finds them here like any other task module.
"""
