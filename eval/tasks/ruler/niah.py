"""RULER's eight needle-in-a-haystack tasks (Hsieh et al. 2024, arXiv:2404.06654), under RULER's names,
with the settings of its ``scripts/synthetic.yaml`` (NVIDIA/RULER ``c3f5e3b4``):

=================  ========  ====================  =====================  ===========================
task               haystack  keys → values         needles                asked
=================  ========  ====================  =====================  ===========================
niah_single_1      noise     words → numbers       1                      1 key
niah_single_2      essay     words → numbers       1                      1 key
niah_single_3      essay     words → uuids         1                      1 key
niah_multikey_1    essay     words → numbers       4 keys                 1 key
niah_multikey_2    needle    words → numbers       1 (haystack: needles)  1 key
niah_multikey_3    needle    uuids → uuids         1 (haystack: needles)  1 key
niah_multivalue    essay     words → numbers       1 key, 4 values        every value of 1 key
niah_multiquery    essay     words → numbers       4 keys                 4 keys
=================  ========  ====================  =====================  ===========================

``essay`` is the data source (the bundled KJV held-out books by default; a local text or a
``datasets`` id such as PG-19: RULER's is Paul Graham's essays). Prompts, answers and lengths are
``niah.py``'s (``niah_gen``); metric ``string_match_all``; 128 tokens generated.
``niah_multikey`` (the name before this module) is niah_multikey_1.
"""

from __future__ import annotations

from typing import ClassVar

from ..base import TASKS
from .base import RulerTask
from .niah_gen import NiahConfig, generate_niah

__all__ = ["CONFIGS", "NiahTask"]

CONFIGS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_needle_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_needle_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_needle_q=4),
}


class NiahTask(RulerTask):
    """Base of the niah tasks: ``config`` is the task's line of RULER's synthetic.yaml."""

    family = "niah"
    config: ClassVar[NiahConfig]

    def generate(self, length, num_samples):
        o = self.options
        return generate_niah(self.config, count=self.count, template=self.template, max_seq_length=length,
                             num_samples=num_samples, seed=o.seed, tokens_to_generate=self.budget,
                             essay=self.essay_words if self.essay else None, what=self.name,
                             max_draws=o.max_draws)


def _task(name: str, doc: str) -> type[NiahTask]:
    cfg = CONFIGS[name]
    cls = type(name.title().replace("_", ""), (NiahTask,),
               {"name": name, "config": cfg, "essay": cfg.type_haystack == "essay",
                "uses_data": cfg.type_haystack == "essay", "__doc__": doc, "__module__": __name__})
    return cls


NiahSingle1 = _task("niah_single_1", "RULER niah_single_1: one word → 7-digit number needle in repeated noise.")
NiahSingle2 = _task("niah_single_2", "RULER niah_single_2: one word → 7-digit number needle in an essay.")
NiahSingle3 = _task("niah_single_3", "RULER niah_single_3: one word → UUID needle in an essay.")
NiahMultikey1 = _task("niah_multikey_1", "RULER niah_multikey_1: four word → number needles in an essay, one asked.")
NiahMultikey2 = _task("niah_multikey_2", "RULER niah_multikey_2: a word → number needle among needles.")
NiahMultikey3 = _task("niah_multikey_3", "RULER niah_multikey_3: a UUID → UUID needle among needles.")
NiahMultivalue = _task("niah_multivalue", "RULER niah_multivalue: four numbers for one word in an essay, all asked.")
NiahMultiquery = _task("niah_multiquery", "RULER niah_multiquery: four word → number needles in an essay, all asked.")
TASKS.add("niah_multikey", NiahMultikey1)  # the name before RULER's eight niah tasks
