"""Train the bundled reference model: a small Llama on the KJV training books that can copy
and retrieve inside its window.

Run from a checkout (needs Debian's ``bible-kjv``; about 55 min on 2 CPU cores): the bundled
model is two stages, from scratch and then a short second stage (the exact commands are in its
model card, ``ropescale/reference/kjv-llama/README.md``)::

    ropescale reference train --output stage1 --steps 1800 --answer-end ''
    ropescale reference train --init stage1 --output DIR --steps 700 --lr 1e-3 --warmup 20 \
        --mix kjv=0.7,passkey=0.12,needle=0.08,repeat=0.06,random=0.04 --probe-every 100
    ropescale reference card --model DIR      # measures it and writes the model card

It writes the tokenizer, ``config.json``, ``model.safetensors`` and ``training.json`` (loss
curve, copy-probe curve; stage 1's under ``stage1``) into ``--output``.

Recipe: byte-level BPE (vocab 4096) trained on the training books only; ``LlamaForCausalLM``
hidden 256, 4 layers, 8 heads (head_dim 32), MLP 688, untied embeddings, training window
T = ``max_position_embeddings`` = 128, ``rope_theta`` 10000; AdamW (lr 2e-3, betas 0.9/0.95,
weight decay 0.1), batch 32 windows of T tokens, 100 warm-up steps then cosine decay to 10 %.

Copying needs induction heads, and they only form when the data rewards them from the start.
So every batch mixes, from the first step (shares set by ``--mix``), windows of plain KJV text
with synthetic documents generated on the fly from the *training* books:

- ``passkey``: KJV verses as filler, the passkey task's information line at a random depth,
  its question and the key (3–7 digits) — the passkey task's templates over KJV filler;
- ``needle``: the same with the needle task's magic-number line and question;
- ``repeat``: a KJV passage of 8–60 tokens repeated until the window is full;
- ``random``: a run of 5–30 random tokens repeated until the window is full (the cleanest
  induction signal: nothing but copying predicts it).

A copy probe on *held-out* books is logged every ``--probe-every`` steps (loss on the first vs
the second copy of a 40-token passage), so the phase change is visible in ``training.json``.
"""

from __future__ import annotations

import json
import math
import platform
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from ropescale.errors import InvalidInput
from ropescale.reference import kjv
from ropescale.runs.config import check_threads

from ..tasks import needle, passkey
from ..tasks.prompts import cycle_units, random_key, sentence_units
from ..writable import check_folder

EOT = "<|endoftext|>"
DEFAULT_MIX = {"kjv": 0.45, "passkey": 0.15, "needle": 0.1, "repeat": 0.15, "random": 0.15}
# until induction heads have formed (the copy probe's second copy ≥ COPY_MARGIN nats better)
COPY_MIX = {"kjv": 0.1, "passkey": 0.15, "needle": 0.1, "repeat": 0.3, "random": 0.35}
COPY_MARGIN = 2.0


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``.

    Args:
        texts: the training texts.
        vocab_size: the vocabulary's size.

    Returns:
        The tokenizer.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, model_max_length=int(1e9)
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All documents' tokens, each followed by EOT: ``[n_tokens]`` int64."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


class Mix:
    """Draws training windows of exactly ``window`` tokens from the KJV stream and the synthetic
    document kinds, in the shares of ``mix``."""

    def __init__(self, tokenizer, train_ids: torch.Tensor, units: list[list[int]], window: int,
                 mix: dict[str, float], rng: random.Random, answer_end: str = "."):
        self.tok, self.ids, self.units, self.T, self.rng = tokenizer, train_ids, units, window, rng
        self.end = tokenizer(answer_end, add_special_tokens=False)["input_ids"] if answer_end else []
        self.set_mix(mix)

    def set_mix(self, mix: dict[str, float]) -> None:
        """Set the training mix: each window's kind drawn with these weights.

        Args:
            mix: ``{kind: weight}`` (``kjv``, ``passkey``, ``needle``, ...).
        """
        self.kinds, self.weights = list(mix), list(mix.values())

    def _kjv(self) -> list[int]:
        s = self.rng.randrange(self.ids.numel() - self.T)
        return self.ids[s : s + self.T].tolist()

    def _filler(self):
        return cycle_units(self.units, self.rng.randrange(len(self.units)))

    def _passkey(self) -> list[int]:
        key = random_key(self.rng, self.rng.randint(3, 7))
        p = passkey.make_prompt(self.tok, self._filler(), length=self.T - len(self.end), depth=self.rng.random(),
                                key=key)
        return p.ids + p.answer_ids + self.end

    def _needle(self) -> list[int]:
        number = random_key(self.rng, self.rng.randint(3, 7))
        p = needle.make_prompt(self.tok, self._filler(), length=self.T - len(self.end), depth=self.rng.random(),
                               word=self.rng.choice(needle.WORDS), number=number,
                               header=False)  # the bundled model's recipe: RULER's header would fill T = 128
        return p.ids + p.answer_ids + self.end

    def _repeat(self, piece: list[int]) -> list[int]:
        return (piece * (self.T // len(piece) + 1))[: self.T]

    def window_ids(self) -> list[int]:
        """One training window's token ids, of a kind drawn from the mix.

        Returns:
            ``window`` token ids.
        """
        kind = self.rng.choices(self.kinds, self.weights)[0]
        if kind == "kjv":
            return self._kjv()
        if kind == "passkey":
            return self._passkey()
        if kind == "needle":
            return self._needle()
        if kind == "repeat":
            n = self.rng.randint(8, 60)
            s = self.rng.randrange(self.ids.numel() - n)
            return self._repeat(self.ids[s : s + n].tolist())
        if kind == "random":
            n = self.rng.randint(5, 30)
            return self._repeat([self.rng.randrange(1, len(self.tok)) for _ in range(n)])
        raise ValueError(f"unknown document kind {kind!r}")

    def batch(self, size: int) -> torch.Tensor:
        """A batch of training windows.

        Args:
            size: windows in the batch.

        Returns:
            ``[size, window]`` int64 token ids.
        """
        return torch.tensor([self.window_ids() for _ in range(size)], dtype=torch.long)  # [b, T]


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, window: int) -> float:
    """Mean next-token loss over non-overlapping windows of ``window`` tokens."""
    was_training = model.training
    model.eval()
    n = stream.numel() // window
    windows = stream[: n * window].view(n, window)  # [n_windows, T]
    total, count = 0.0, 0
    for batch in windows.split(64):
        loss = model(batch, labels=batch).loss
        total += loss.item() * batch.numel()
        count += batch.numel()
    model.train(was_training)
    return total / count


@torch.no_grad()
def copy_probe(model: LlamaForCausalLM, stream: torch.Tensor, n: int = 40, passages: int = 32) -> dict:
    """Mean loss [nats] on the first and on the second copy of held-out ``n``-token passages
    repeated right after themselves (2n tokens, inside the window), and top-1 accuracy on the second."""
    was_training = model.training
    model.eval()
    step = (stream.numel() - n) // passages
    ids = torch.stack([stream[i * step : i * step + n] for i in range(passages)])  # [p, n]
    ids = torch.cat([ids, ids], dim=1)  # [p, 2n]
    logits = model(ids).logits[:, :-1].float()  # [p, 2n-1, V]
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [p, 2n-1]
    first, second = loss[:, : n - 1].mean().item(), loss[:, n - 1 :].mean().item()
    acc = (logits[:, n - 1 :].argmax(-1) == ids[:, n:]).float().mean().item()
    model.train(was_training)
    return {"first_copy_loss": round(first, 4), "second_copy_loss": round(second, 4), "second_copy_top1": round(acc, 4)}


def mix_text(mix: dict[str, float]) -> str:
    """``{"kjv": 0.7, ...}`` → ``"kjv=0.7,..."`` (the form ``--mix`` takes)."""
    return ",".join(f"{k}={v}" for k, v in mix.items())


def _parse_mix(text: str, option: str = "--mix") -> dict[str, float]:
    """``"kjv=0.7,passkey=0.3"`` → shares normalised to sum 1; ``InvalidInput`` in one line."""
    mix = {}
    for item in text.split(","):
        k, eq, v = item.partition("=")
        try:
            share = float(v) if eq else None
        except ValueError:
            share = None
        if share is None or not math.isfinite(share) or share < 0:
            raise InvalidInput(f"{option} {text!r}: {item!r} is not KIND=SHARE with a share >= 0 "
                               f"(kinds: {', '.join(DEFAULT_MIX)})")
        mix[k.strip()] = share
    unknown = set(mix) - set(DEFAULT_MIX)
    if unknown:
        raise InvalidInput(f"{option}: unknown kinds {sorted(unknown)}; known: {', '.join(DEFAULT_MIX)}")
    total = sum(mix.values())
    if total <= 0:
        raise InvalidInput(f"{option} {text!r}: the shares add up to 0")
    return {k: v / total for k, v in mix.items()}


def check_cores(threads: int) -> None:
    """``--threads`` at most this machine's CPU cores (``InvalidInput`` in one line)."""
    try:
        check_threads(threads)
    except ValueError as e:
        raise InvalidInput(f"--threads: {e}") from None


def train(output: Path, *, steps: int = 1500, batch_size: int = 32, window: int = 128, lr: float = 2e-3,
          warmup: int = 100, vocab_size: int = 4096, mix: str | None = None, copy_mix: str | None = None,
          copy_phase_max: int = 600, probe_every: int = 50, answer_end: str = ".", init: Path | None = None,
          seed: int = 0, threads: int = 2) -> dict:
    """Train the reference model into ``output`` (``ropescale reference train``; the options are
    the CLI's) and return the summary written to ``training.json``. ``mix``/``copy_mix``:
    ``"kind=share,..."`` (None: ``DEFAULT_MIX`` / ``COPY_MIX``); ``init``: a model folder to start
    from (a second stage, no copy phase). Raises ``InvalidInput`` (one line) before any work for
    a bad mix, an ``init`` that is no model folder, more threads than CPU cores or an output
    folder that cannot be written."""
    args = SimpleNamespace(output=Path(output), steps=steps, batch_size=batch_size, window=window, lr=lr,
                           warmup=warmup, vocab_size=vocab_size, copy_phase_max=copy_phase_max,
                           probe_every=probe_every, answer_end=answer_end, init=Path(init) if init else None,
                           seed=seed, threads=threads)
    mix = _parse_mix(mix_text(DEFAULT_MIX) if mix is None else mix, "--mix")
    copy_mix = _parse_mix(mix_text(COPY_MIX) if copy_mix is None else copy_mix, "--copy-mix")
    if args.init and not (args.init / "config.json").is_file():
        raise InvalidInput(f"--init {args.init}: no config.json (a model folder `ropescale reference train` wrote)")
    check_cores(args.threads)
    check_folder(args.output, f"--output {args.output}")  # before training, not after (the model would be lost)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer, train_ids, held_ids, units = _data(args, mix)
    model = _model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    data = Mix(tokenizer, train_ids, units, args.window, mix if args.init else copy_mix, random.Random(args.seed),
               args.answer_end)
    log, probes, copy_phase_end, train_s = _train_steps(args, model, data, held_ids, mix)
    held = heldout_loss(model, held_ids, args.window)
    print(f"held-out loss at T: {held:.4f} (PPL {math.exp(held):.1f})")

    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    summary = {
        "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size,
        "window": args.window, "lr": args.lr, "warmup": args.warmup, "mix": mix,
        "copy_mix": None if args.init else copy_mix, "answer_end": args.answer_end,
        "init": str(args.init) if args.init else None,
        "copy_phase_end": copy_phase_end,
        "parameters": n_params, "train_tokens": train_ids.numel(),
        "heldout_tokens": held_ids.numel(), "train_seconds": round(train_s, 1),
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "final_train_loss": log[-1]["loss"],
        "heldout_loss_at_T": round(held, 4), "heldout_ppl_at_T": round(math.exp(held), 2),
        "probe_every": args.probe_every, "copy_probe": probes[-1], "log": log, "probes": probes,
    }
    if args.init and (args.init / "training.json").is_file():
        summary["stage1"] = json.loads((args.init / "training.json").read_text(encoding="utf-8"))
    (args.output / "training.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"saved to {args.output}")
    return summary


def _data(args, mix: dict[str, float]):
    """The tokenizer (``--init``'s, else trained on the training books) and the token streams:
    ``(tokenizer, training ids [n], held-out ids [m], the training books' sentence units)``."""
    train_books, held_books = kjv.split("train"), kjv.split("heldout")
    t0 = time.time()
    tokenizer = (PreTrainedTokenizerFast.from_pretrained(args.init) if args.init
                 else train_tokenizer([t for _, t in train_books], args.vocab_size))
    train_ids = token_stream(tokenizer, [t for _, t in train_books])
    held_ids = token_stream(tokenizer, [t for _, t in held_books])
    units = sentence_units(tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for _, t in train_books])
    print(f"tokenizer {time.time() - t0:.1f}s; train {train_ids.numel()} tokens ({len(units)} units), "
          f"held-out {held_ids.numel()} tokens; mix {mix}")
    return tokenizer, train_ids, held_ids, units


def _model(args, tokenizer) -> LlamaForCausalLM:
    """``--init``'s model, else the recipe's Llama from scratch (the module docstring's sizes)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=args.window,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM.from_pretrained(args.init) if args.init else LlamaForCausalLM(config)


def _train_steps(args, model: LlamaForCausalLM, data: Mix, held_ids: torch.Tensor, mix: dict[str, float]):
    """The optimiser steps, logging the loss every 25 and probing copying every ``probe_every``;
    the copy phase ends (``data`` switched to ``mix``) at the first probe with a margin of
    ``COPY_MARGIN`` or at ``copy_phase_max``. ``(log, probes, copy phase end, seconds)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=args.warmup, num_training_steps=args.steps, min_lr_rate=0.1
    )
    copy_phase_end = 0 if args.init else None
    log: list[dict] = []
    probes: list[dict] = []
    t0 = time.time()
    model.train()
    for step in range(1, args.steps + 1):
        batch = data.batch(args.batch_size)  # [b, T]
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps:
            el = time.time() - t0
            log.append({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(el, 1)})
            print(f"step {step}/{args.steps} loss {loss.item():.3f} {el:.0f}s "
                  f"({step * batch.numel() / el:.0f} tok/s)", flush=True)
        if step % args.probe_every == 0 or step == args.steps:
            probes.append({"step": step, **copy_probe(model, held_ids)})
            print(f"  copy probe: {probes[-1]}", flush=True)
            p = probes[-1]
            if copy_phase_end is None and (p["first_copy_loss"] - p["second_copy_loss"] >= COPY_MARGIN
                                           or step >= args.copy_phase_max):
                copy_phase_end = step
                data.set_mix(mix)
                print(f"  step {step}: copy phase over, switching to the main mix", flush=True)
    return log, probes, copy_phase_end, time.time() - t0
