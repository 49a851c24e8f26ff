"""Train the bundled reference model: a small Llama on the KJV training books.

Run from a checkout (needs Debian's ``bible-kjv``; about 20 min on 2 CPU cores)::

    python -m ropescale.reference.train --output ropescale/reference/kjv-llama

It writes the tokenizer, ``config.json``, ``model.safetensors``, ``training.json`` (loss
curve and held-out loss) and ``README.md`` (the model card) into ``--output``.

Recipe: byte-level BPE (vocab 4096) trained on the training books only; ``LlamaForCausalLM``
hidden 256, 4 layers, 8 heads (head_dim 32), MLP 688, untied embeddings, training window
T = ``max_position_embeddings`` = 128, ``rope_theta`` 10000; AdamW (lr 2e-3, betas 0.9/0.95,
weight decay 0.1), batch 32 random windows of T tokens, 100 warm-up steps then cosine decay
to 10 % of the peak rate.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from ropescale.reference import kjv

EOT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
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


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, window: int) -> float:
    """Mean next-token loss over non-overlapping windows of ``window`` tokens."""
    model.eval()
    n = stream.numel() // window
    windows = stream[: n * window].view(n, window)  # [n_windows, T]
    total, count = 0.0, 0
    for batch in windows.split(64):
        loss = model(batch, labels=batch).loss
        total += loss.item() * batch.numel()
        count += batch.numel()
    model.train()
    return total / count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--window", type=int, default=128, help="training window T (tokens)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_books, held_books = kjv.split("train"), kjv.split("heldout")
    t0 = time.time()
    tokenizer = train_tokenizer([t for _, t in train_books], args.vocab_size)
    train_ids = token_stream(tokenizer, [t for _, t in train_books])
    held_ids = token_stream(tokenizer, [t for _, t in held_books])
    print(f"tokenizer {time.time() - t0:.1f}s; train {train_ids.numel()} tokens, "
          f"held-out {held_ids.numel()} tokens")

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
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=args.warmup, num_training_steps=args.steps, min_lr_rate=0.1
    )
    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    t0 = time.time()
    model.train()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train_ids.numel() - args.window, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + args.window] for s in starts.tolist()])  # [b, T]
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
    train_s = time.time() - t0
    held = heldout_loss(model, held_ids, args.window)
    print(f"held-out loss at T: {held:.4f} (PPL {math.exp(held):.1f})")

    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    summary = {
        "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size,
        "window": args.window, "lr": args.lr, "warmup": args.warmup,
        "parameters": n_params, "train_tokens": train_ids.numel(),
        "heldout_tokens": held_ids.numel(), "train_seconds": round(train_s, 1),
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "final_train_loss": log[-1]["loss"],
        "heldout_loss_at_T": round(held, 4), "heldout_ppl_at_T": round(math.exp(held), 2),
        "log": log,
    }
    (args.output / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.output / "README.md").write_text(model_card(summary, train_books, held_books))
    print(f"saved to {args.output}")


def model_card(s: dict, train_books: list, held_books: list) -> str:
    held = ", ".join(name for name, _ in held_books)
    return f"""# kjv-llama — ropescale's reference model

A tiny `LlamaForCausalLM` trained from scratch on the King James Bible so that RoPE
length-extrapolation experiments run offline. Not a useful language model for anything else.

- **Text**: Debian `bible-kjv` (public domain), verse numbers and chapter headings removed,
  one document per book. Held out (never seen by tokenizer or model): {held}
  ({len(held_books)} books, {s['heldout_tokens']:,} tokens). Training: the other
  {len(train_books)} books ({s['train_tokens']:,} tokens).
- **Tokenizer**: byte-level BPE, vocab 4096, `<|endoftext|>` as BOS/EOS.
- **Model**: hidden 256, 4 layers, 8 heads, head_dim 32, MLP 688, untied embeddings,
  {s['parameters']:,} parameters, `max_position_embeddings` = training window T = {s['window']},
  `rope_theta` 10000, vanilla RoPE.
- **Training**: seed {s['seed']}, {s['steps']} steps of {s['batch_size']} random windows of
  {s['window']} tokens, AdamW lr {s['lr']} (betas 0.9/0.95, weight decay 0.1), {s['warmup']}
  warm-up steps, cosine to 10 %, grad-norm clip 1.0; {s['train_seconds']:.0f} s on
  {s['threads']} CPU threads (torch {s['torch']}).
- **Result**: final training loss {s['final_train_loss']}; held-out loss at T
  {s['heldout_loss_at_T']} (perplexity {s['heldout_ppl_at_T']}).

Reproduce: `python -m ropescale.reference.train --output DIR --seed {s['seed']} --steps {s['steps']}`
(bit-exact reproduction also needs the same torch build and thread count).
"""


if __name__ == "__main__":
    main()
