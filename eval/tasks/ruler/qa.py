"""RULER's QA tasks (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER ``c3f5e3b4``
``scripts/data/synthetic/qa.py``): ``qa_1`` on SQuAD v2 dev, ``qa_2`` on HotpotQA dev (distractor);
a question, its gold paragraphs among others to the length; ``string_match_part``; 32 tokens.

The data: ``dataset_path`` (the raw JSON RULER's ``download_qa_dataset.sh`` fetches:
``dev-v2.0.json`` / ``hotpot_dev_distractor_v1.json``), else through ``datasets``
(``rajpurkar/squad_v2`` validation / ``hotpotqa/hotpot_qa`` distractor validation, rebuilt into
that JSON). Offline without ``dataset_path`` the task is refused in one line, before anything runs; a
``dataset_path`` that is not that JSON (not JSON, not UTF-8, another layout), or holds fewer answerable
questions than ``pre_samples + num_samples``, is refused in one line (``DataError``) before any cell.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from ropescale.runs.data import DataError

from .base import RulerOptions, RulerTask
from .qa_gen import generate_qa, hotpot_from_rows, read_hotpotqa, read_squad, squad_from_rows

__all__ = ["LAYOUTS", "QaOptions", "QaTask", "read_dataset"]

HUB = {"squad": ("rajpurkar/squad_v2", None, "validation"), "hotpotqa": ("hotpotqa/hotpot_qa", "distractor",
                                                                          "validation")}


class _SquadAnswer(BaseModel):
    text: str


class _SquadQuestion(BaseModel):
    question: str
    answers: list[_SquadAnswer]
    is_impossible: bool


class _SquadParagraph(BaseModel):
    context: str
    qas: list[_SquadQuestion]


class _SquadArticle(BaseModel):
    paragraphs: list[_SquadParagraph]


class _Squad(BaseModel):
    data: list[_SquadArticle]


class _HotpotQuestion(BaseModel):
    question: str
    answer: str
    context: list[tuple[str, list[str]]]


# what qa.py's readers take of the raw JSON (other keys are left alone): (layout, RULER's file name)
LAYOUTS = {"squad": (TypeAdapter(_Squad), "SQuAD v2's dev-v2.0.json"),
           "hotpotqa": (TypeAdapter(list[_HotpotQuestion]), "HotpotQA's hotpot_dev_distractor_v1.json")}


_JSON_KINDS = {"model_type": "object", "dict_type": "object", "list_type": "list"}


def read_dataset(path: str, dataset: str, what: str):
    """The raw JSON at ``path`` checked against ``dataset``'s layout (``LAYOUTS``: the keys RULER's
    ``read_squad``/``read_hotpotqa`` read). Raises ``DataError`` in one line: unreadable, not UTF-8,
    not JSON, another layout (the first key path that differs)."""
    layout, file = LAYOUTS[dataset]
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{what}: dataset_path {path}: not a UTF-8 text file; give {file} as RULER downloads it"
                        ) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{what}: dataset_path {path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                        f"give {file} as RULER downloads it") from None
    except OSError as e:
        raise DataError(f"{what}: dataset_path {path}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        return layout.dump_python(layout.validate_python(raw))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the top level"
        kind = _JSON_KINDS.get(first["type"])
        msg = f"expected a JSON {kind}, got {type(first['input']).__name__}" if kind else first["msg"]
        raise DataError(f"{what}: dataset_path {path}: not {file} as RULER reads it ({where}: {msg})") from None


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE",
                                                                                "HF_DATASETS_OFFLINE"))


class QaOptions(RulerOptions):
    """RULER qa's options: a local copy of the data set (SQuAD, HotpotQA) and the questions skipped first."""

    dataset_path: str | None = Field(None, description="a local copy of the data set's raw JSON (as RULER reads it)")
    pre_samples: int = Field(0, ge=0, description="questions skipped first (RULER's pre_samples)")


class QaTask(RulerTask):
    """Base of qa_1 / qa_2."""

    family = "qa"
    Options = QaOptions
    dataset: str

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        opts = cls.__dict__.get("Options")
        if opts is None and cls.__dict__.get("name"):
            dataset = cls.dataset

            class Options(QaOptions):
                @model_validator(mode="after")
                def _data_reachable(self):
                    if self.dataset_path is None and _offline():
                        hub = HUB[dataset][0]
                        raise ValueError(f"{hub} is read through datasets, but this session is offline "
                                         "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); give dataset_path: a local copy of "
                                         "the JSON RULER downloads")
                    if self.dataset_path is not None and not Path(self.dataset_path).is_file():
                        raise ValueError(f"dataset_path {self.dataset_path}: no such file")
                    return self

            cls.Options = Options

    @cached_property
    def data(self) -> tuple[list[dict], list[str]]:
        o = self.options
        if o.dataset_path:
            raw = read_dataset(o.dataset_path, self.dataset, self.name)
        else:
            import datasets

            hub, config, split = HUB[self.dataset]
            try:
                rows = datasets.load_dataset(hub, config, split=split)
            except Exception as e:  # noqa: BLE001 — the hub client raises many kinds
                raise DataError(f"{self.name}: cannot load {hub} ({type(e).__name__}); give dataset_path: a local "
                                "copy of the JSON RULER downloads") from None
            raw = squad_from_rows(rows) if self.dataset == "squad" else hotpot_from_rows(rows)
        return read_squad(raw) if self.dataset == "squad" else read_hotpotqa(raw)

    def cache_key(self, length):
        """The base key, with the QA data's fingerprint as the haystack (the dataset's path left out).

        Args:
            length: the samples' length [tokens].

        Returns:
            The key (JSON values).
        """
        qas, docs = self.data
        digest = hashlib.sha256(json.dumps([qas, docs]).encode()).hexdigest()[:16]
        return super().cache_key(length) | {"haystack": digest, "options": self.options.model_dump(
            exclude={"batch_size", "cache", "num_samples", "dataset_path"})}

    def generate(self, length, num_samples):
        qas, docs = self.data
        o = self.options
        if len(qas) < o.pre_samples + num_samples:  # qa.py would stop at an IndexError
            source = o.dataset_path or HUB[self.dataset][0]
            raise DataError(f"{self.name}: {source} has {len(qas)} answerable questions, fewer than the "
                            f"{o.pre_samples + num_samples} asked (pre_samples {o.pre_samples} + num_samples "
                            f"{num_samples})")
        return generate_qa(qas, docs, count=self.count, template=self.template, max_seq_length=length,
                           num_samples=num_samples, seed=o.seed, tokens_to_generate=self.budget,
                           pre_samples=o.pre_samples, what=self.name, max_draws=o.max_draws)


class Qa1(QaTask):
    """RULER qa_1: a SQuAD v2 question over its paragraph among others."""

    name = "qa_1"
    dataset = "squad"


class Qa2(QaTask):
    """RULER qa_2: a HotpotQA question over its paragraphs among others."""

    name = "qa_2"
    dataset = "hotpotqa"
