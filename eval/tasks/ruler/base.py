"""What every RULER task shares (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER ``c3f5e3b4``):
samples from RULER's own generators (``*_gen``), cached (``cache``), read by the model
with RULER's template and answer prefix, answered by batched greedy decoding with the KV cache for
RULER's per-task generation budget, scored with RULER's metric.

- **Template**: ``base`` (RULER's default, ``Templates['base'] = "{task_template}"``), ``chat`` (the
  tokenizer's own chat template around the task, one user turn and the generation prompt), or a
  model template string holding ``{task_template}`` (as RULER's ``template.py`` has them). As in
  RULER's ``prepare.py`` the model template is joined before generation, so it counts in the length
  (and niah's singular rewrite applies to it too). A chat template is rendered from the tokenizer
  and recorded in every record (``template_text``); the option itself is in the run's identity.
- **Lengths** are RULER's: prompt tokens (``tokenizer.tokenize``, no special tokens) + the
  generation budget ≤ L. A length that cannot hold a sample is refused in one line, never cut; the
  model reads the prompt with the tokenizer's special tokens (a BOS where the tokenizer adds one,
  not a second one where the template text starts with it), and every record carries the token
  counts the model read (``prompt_tokens``: per sample, ``prompt_tokens_max``).
- **Decoding**: greedy, ``tokens_to_generate`` new tokens at most, stopping at the end-of-sequence
  token(s); ``batch_size`` prompts a forward, left-padded, with position ids counted from each
  prompt's first token (so padding changes no position). Attention-rule strategies (ReRoPE, …)
  decode one prompt at a time: their kernels take no padding mask.
- **Score**: RULER's ``postprocess_pred`` then ``string_match_all`` (or ``string_match_part`` for QA):
  the mean per-sample score × 100, rounded to 2 places as RULER prints it.

Options shared by every RULER task: ``num_samples`` (RULER: 500), ``seed`` (RULER: 42),
``template``, ``tokens_to_generate`` (None: RULER's budget for the task; another value departs from
RULER and is recorded), ``batch_size``, ``cache``, ``max_draws`` (None: RULER's endless draws at the
smallest haystack; a number refuses the length after that many, departing from RULER only where
RULER would still be drawing).
"""

from __future__ import annotations

import hashlib
import logging
import string
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from ropescale.compat import cache_kwarg, output_cache
from ropescale.runs.data import DataError
from ropescale.runs.memory import PY_LIST_SLOT, Need, forward_bytes, kv_cache_bytes, model_dims

from ..base import Metric, Task, TaskOptions, progress
from ..prompts import PromptError
from .cache import CacheStats, cached_samples, tokenizer_fingerprint
from .spec import FAMILIES, Family, RulerSample, join_template, postprocess_pred, sample_score
from .text import essay_words, generator_versions

__all__ = ["RULER_COMMIT", "GreedyTask", "RulerExample", "RulerOptions", "RulerTask", "check_model_template", "eos_ids",
           "greedy_batch", "model_template"]

RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
# in the cache key: a length refused before "sizes" (after a cap of 20,000 draws, or 100 draws 5% over) may hold
# samples now, so those cached refusals are not read back
REFUSALS = "sizes"
BASE = "{task_template}"
_MARK = "\uffffTASK\uffff"


class RulerOptions(TaskOptions):
    """What every RULER task shares: samples, seed, the model template, the generation budget, batch, the sample
    cache and the draw cap."""

    num_samples: int = Field(500, ge=1, description="samples per length (RULER: 500)")
    seed: int = Field(42, description="RULER's random_seed")
    template: str = Field("base", description="base (RULER's default), chat (the tokenizer's chat template), or a "
                                              "model template holding {task_template}")
    tokens_to_generate: int | None = Field(None, ge=1, description="generation budget; default RULER's per task")
    batch_size: int = Field(8, ge=1, description="prompts decoded together")
    cache: bool = Field(True, description="reuse generated samples across runs (ROPESCALE_CACHE/ruler)")
    max_draws: int | None = Field(None, ge=1, description=(
        "draws at the smallest haystack before a length is refused; None (RULER's): draw until one fits, refusing "
        "only a length no draw can fit"))

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        return v if v in ("base", "chat") else check_model_template(v)

    def key(self) -> dict[str, Any]:
        # max_draws left at RULER's (none): out of the key, so runs from before the option resume
        return self.model_dump(exclude={"batch_size", "cache", *({"max_draws"} if self.max_draws is None else ())})


_BRACES = "a literal brace is written {{{{ or }}}} (the model template is formatted, then the joined prompt)"


def _fields(text: str) -> list[str]:
    """The placeholders of a ``str.format`` string as written between the braces (``task_template``,
    ``x!r``, ``x:>9``); ``ValueError`` for a lone brace."""
    return [name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
            for _, name, spec, conv in string.Formatter().parse(text) if name is not None]


def check_model_template(text: str) -> str:
    """``text`` when it is a model template RULER's ``prepare.py`` can use: ``{task_template}`` (the one
    placeholder) at least once, and nothing that the two ``str.format`` calls it goes through —
    ``text.format(task_template=...)``, then the joined prompt's ``.format(context=..., ...)`` — would
    read as another placeholder or a lone brace. ``ValueError`` in one line otherwise (a ``KeyError``
    or ``ValueError`` from deep in a generator before)."""
    try:
        names = _fields(text)
        stray = [n for n in names if n != "task_template"]
        # what the prompt's format sees of the model template's own text
        stray += _fields(text.format(task_template="")) if not stray else []
    except ValueError:
        raise ValueError(f"a lone '{{' or '}}': the one placeholder is {{task_template}}; "
                         f"{_BRACES}") from None
    if stray:
        raise ValueError(f"{{{stray[0]}}} is not a placeholder of a model template (the one placeholder "
                         f"is {{task_template}}); {_BRACES}")
    if not names:
        raise ValueError("expected base, chat, or a model template holding {task_template}")
    return text


def model_template(kind: str, tokenizer) -> str:
    """The model template RULER's ``prepare.py`` formats with ``task_template``: ``base``, the
    tokenizer's chat template around one user turn (braces escaped), or ``kind`` itself."""
    if kind == "base":
        return BASE
    if kind != "chat":
        return kind
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("template: chat, but the tokenizer has no chat template; use template: base, or give "
                          "the model template as a string holding {task_template}")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=True)
    # its braces are text: doubled twice, as they go through two formats (model template, then the prompt)
    return text.replace("{", "{{{{").replace("}", "}}}}").replace(_MARK, "{task_template}")


@dataclass(frozen=True)
class RulerExample:
    """A sample and the token ids the model reads (``[n]``, special tokens included)."""

    sample: RulerSample
    ids: list[int]


class GreedyTask(Task):
    """What every task answered by greedy generation from cached, offline-generated samples shares — the RULER tasks
    (``RulerTask``) and the synthetic ones (``eval.tasks.synthetic.base.GeneratedTask``): the samples of a length from
    the cache or generated (``cache.cached_samples``), the tokens the model reads, the memory a cell needs, and batched
    greedy decoding with the KV cache (``greedy_batch``). Subclasses set ``budget`` and implement ``generate`` and
    ``cache_key``."""

    budget_source: ClassVar[str] = "tokens_to_generate"  # where the generation budget comes from, for messages

    @property
    def budget(self) -> int:
        """Tokens generated per answer."""
        raise NotImplementedError

    def generate(self, length: int, num_samples: int) -> list[RulerSample]:
        """The task's samples at a length (its generator's).

        Args:
            length: the samples' length [tokens].
            num_samples: how many.

        Returns:
            The samples (``input`` + ``answer_prefix`` is what the model reads; ``outputs`` the gold answers).
        """
        raise NotImplementedError

    def cache_key(self, length: int) -> dict[str, Any]:
        """What names the samples at a length in the cache (JSON values)."""
        raise NotImplementedError

    @cached_property
    def generation(self) -> dict[int, CacheStats]:
        """How each length's samples were had (cache hit or generated, seconds)."""
        return {}

    def samples(self, length: int) -> list[RulerSample]:
        """The task's samples at a length, from the cache or generated (and cached).

        Args:
            length: the samples' length [tokens].

        Returns:
            ``num_samples`` samples.
        """
        o = self.options
        samples, stats = cached_samples(self.cache_key(length), o.num_samples,
                                        lambda: self.generate(length, o.num_samples), use=o.cache)
        self.generation[length] = stats
        logging.getLogger("ropescale").info("%s @ %d: %d samples %s in %.2fs", self.name, length, len(samples),
                                            "read from the cache" if stats.cached else "generated", stats.seconds)
        return samples

    def input_ids(self, prompt: str) -> list[int]:
        """The tokens the model reads: the tokenizer's special tokens, but no second BOS where the
        template text already starts with it."""
        bos = self.tokenizer.bos_token
        return self.tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]

    def examples(self, length: int) -> list[RulerExample]:
        if length <= self.budget:
            raise PromptError(f"{self.name}: length {length} leaves no room for a prompt beside the generation budget "
                              f"of {self.budget} tokens ({self.budget_source})")
        return [RulerExample(s, self.input_ids(s.prompt)) for s in self.samples(length)]

    def memory(self, length: int, model) -> Need:
        """Device: the KV cache of ``batch_size`` prompts and their answers, and one forward's
        activations over them; host: the samples' token ids."""
        o = self.options
        dims = model_dims(model)
        itemsize = model.dtype.itemsize
        return Need(what=f"{self.name} at {length} tokens ({o.num_samples} samples, batch {o.batch_size})",
                    device={"KV cache": kv_cache_bytes(dims, length + 8, itemsize, batch=o.batch_size),
                            "activations": forward_bytes(dims, length, itemsize, batch=o.batch_size)},
                    host={"prompts": o.num_samples * length * PY_LIST_SLOT})

    @torch.no_grad()
    def measure(self, model, examples, indices, *, length, strategy, device, desc) -> list:
        """``(index, decoded generation)`` per example: greedy, ``batch_size`` prompts at a time (one for
        attention-rule strategies: their kernels take no padding mask), longest first."""
        batch = 1 if strategy.kind == "attention" else self.options.batch_size
        eos = eos_ids(self.tokenizer, model)
        order = sorted(indices, key=lambda i: -len(examples[i].ids))  # similar lengths together: less padding
        out = []
        bar = progress(len(order), desc, unit="ex")
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            gens = greedy_batch(model, [examples[i].ids for i in chunk], self.budget, eos, device,
                                pad_id=self.tokenizer.pad_token_id)
            out += [(i, self.tokenizer.decode(g, skip_special_tokens=True)) for i, g in zip(chunk, gens)]
            bar.update(len(chunk))
        bar.close()
        return out

    def predictions(self, parts, examples) -> list[str]:
        """The decoded generations in example order, from the processes' ``measure`` parts (``RuntimeError`` unless
        they cover every example exactly once)."""
        rows = sorted(x for part in parts for x in part)
        if [i for i, _ in rows] != list(range(len(examples))):
            raise RuntimeError(f"{self.name}: the processes' parts do not cover every example exactly once")
        return [p for _, p in rows]

    def prompt_record(self, examples, length: int) -> dict[str, Any]:
        """A cell's record fields on what the model read: tokens per prompt, the longest, how the samples were had."""
        tokens = [len(ex.ids) for ex in examples]
        stats = self.generation.get(length)
        return {"prompt_tokens": tokens, "prompt_tokens_max": max(tokens),
                "generation": {"cached": stats.cached, "seconds": round(stats.seconds, 3)} if stats else None}

    @classmethod
    def plots(cls, records: list[dict], output: Path) -> dict[str, Path]:
        """The headline metric (``metrics[0]``) against length: ``{key}_vs_length.png``."""
        from ...plots import plot_metric

        head = cls.metrics[0]
        path = output / f"{head.key}_vs_length.png"
        plot_metric(records, head.key, head.label, path)
        return {"plot": path}


class RulerTask(GreedyTask):
    """Base of the RULER tasks: subclasses set ``family``, ``Options`` and implement ``generate``."""

    family: ClassVar[str]
    budget_source = "RULER's for this task"
    Options = RulerOptions
    metrics = (Metric(key="score", label="RULER score (%)", higher_is_better=True, fmt="{:.1f}"),)
    essay: ClassVar[bool] = False  # reads the data source as its haystack

    @property
    def spec(self) -> Family:
        """The task's RULER family (its template, answer prefix and generation budget)."""
        return FAMILIES[self.family]

    @property
    def budget(self) -> int:
        """Tokens generated per answer (the option, else the family's)."""
        return self.options.tokens_to_generate or self.spec.tokens_to_generate

    @cached_property
    def template(self) -> str:
        """The task template joined with the model template (``prepare.py``)."""
        return join_template(self.spec, model_template(self.options.template, self.tokenizer))

    @cached_property
    def essay_text(self) -> str:
        """The data source's documents as one text (``DataError`` when empty)."""
        text = "\n".join(self.tokenizer.decode(d.tolist()) for d in self.documents or [])
        source = self.source or "the data source"
        if not text.strip():
            raise DataError(f"{source}: no text for the essay haystack")
        from ..needle import MIN_SENTENCES
        from ..niah_multikey import split_sentences

        sentences = split_sentences(text)
        distinct = set(sentences)
        if len(distinct) < MIN_SENTENCES:  # as needle: a few lines tiled are passkey's filler, not an essay
            raise DataError(f"{source}: the {self.name} essay haystack needs real text, but it has only "
                            f"{len(distinct)} distinct sentence{'s' * (len(distinct) != 1)} ({len(sentences)} in "
                            f"all, e.g. {max(distinct, key=len)[:60]!r}); a few lines repeated are passkey's filler "
                            f"(use task: passkey) — give a text with at least {MIN_SENTENCES} distinct sentences")
        return text

    @cached_property
    def essay_words(self) -> list[str]:
        return essay_words(self.essay_text)

    def count(self, text: str) -> int:
        """RULER's token count: ``len(tokenizer.tokenize(text))`` (no special tokens). A fast tokenizer
        counts through its Rust backend without offsets or token strings (the same tokens; half the
        time of ``tokenize``, which the generators call once per draw: thousands where a sample is
        hard to fit)."""
        fast = self._backend
        if fast is not None:
            return len(fast.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        return len(self.tokenizer.tokenize(text))

    @cached_property
    def _backend(self):
        """The tokenizers backend where it tokenizes as ``tokenize`` does (no truncation set on it,
        special tokens kept whole), else None."""
        tok = self.tokenizer
        backend = getattr(tok, "_tokenizer", None) if getattr(tok, "is_fast", False) else None
        if (backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation is not None
                or getattr(tok, "split_special_tokens", False)):
            return None
        return backend

    def generate(self, length: int, num_samples: int) -> list[RulerSample]:
        """Generate the task's samples at a length, as RULER's generator does (each family's own).

        Args:
            length: the samples' length [tokens].
            num_samples: how many.

        Returns:
            The samples.
        """
        raise NotImplementedError

    def cache_key(self, length: int) -> dict[str, Any]:
        """What names the samples at a length in the cache: RULER's commit, the task, its options, the
        length, the template, the tokenizer's and the haystack's fingerprints.

        Args:
            length: the samples' length [tokens].

        Returns:
            The key (JSON values).
        """
        o = self.options
        return {"ruler": RULER_COMMIT, "refusals": REFUSALS, "task": self.name,
                "options": o.model_dump(exclude={"batch_size", "cache", "num_samples", *({"max_draws"} if o.max_draws
                                                                                         is None else ())}),
                "length": length, "template": self.template, "tokenizer": tokenizer_fingerprint(self.tokenizer),
                "haystack": hashlib.sha256(self.essay_text.encode()).hexdigest()[:16] if self.essay else None,
                "versions": generator_versions()}

    def combine(self, parts, examples, *, length, strategy) -> dict[str, Any]:
        preds = [postprocess_pred(p) for p in self.predictions(parts, examples)]
        per = [sample_score(self.spec.metric, p, list(ex.sample.outputs)) for p, ex in zip(preds, examples)]
        return {"score": round(sum(per) / len(per) * 100, 2), "metric": self.spec.metric, "samples": len(per),
                "nulls": sum(not p for p in preds), "tokens_to_generate": self.budget,
                "template": self.options.template, "template_text": self.template if self.options.template == "chat"
                else None, **self.prompt_record(examples, length), "sample_scores": per, "predictions": preds[:3]}



def eos_ids(tokenizer, model) -> list[int]:
    """The token ids that end a generation: the model's generation config's and the tokenizer's EOS, sorted."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], device,
                 pad_id: int | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token lists), ``max_new_tokens`` at most each, cut before
    the first token in ``eos``. Left-padded to one batch ``[b, n]``; position ids count from each
    prompt's own first token; the KV cache grows one token a step. One prompt: no mask at all."""
    b, n = len(prompts), max(map(len, prompts))
    pad = pad_id if pad_id is not None else (eos[0] if eos else 0)
    ids = torch.full((b, n), pad, dtype=torch.long)
    mask = torch.zeros((b, n), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, n - len(p):] = torch.tensor(p)
        mask[r, n - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    padded = bool((mask == 0).any())
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, n]
    kw = {"attention_mask": mask, "position_ids": pos} if padded else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
    cache, name = output_cache(out), cache_kwarg(model)
    tok = out.logits[:, -1].argmax(-1)  # [b]
    stop = torch.tensor(eos, device=device) if eos else None
    done = torch.zeros(b, dtype=torch.bool, device=device)
    steps = [tok]
    for _ in range(max_new_tokens - 1):
        if stop is not None:
            done |= torch.isin(tok, stop)
            if bool(done.all()):
                break
        if padded:
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
            pos = pos[:, -1:] + 1
            kw = {"attention_mask": mask, "position_ids": pos}
        logits = model(input_ids=tok[:, None], **{name: cache}, use_cache=True, **kw).logits
        tok = logits[:, -1].argmax(-1)
        steps.append(tok)
    gen = torch.stack(steps, dim=1).tolist()  # [b, steps]
    out_ids = []
    for row in gen:
        cut = next((j for j, t in enumerate(row) if t in eos), len(row))
        out_ids.append(row[:cut])
    return out_ids
