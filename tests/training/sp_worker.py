"""Run by ``torchrun --nproc_per_node 2`` (gloo, CPU) from ``test_sequence_parallel.py``: for each
case, one training micro-step of a patched tiny model on whole windows in one process (the
oracle: ``ropescale.training.loop.causal_lm_loss`` and autograd, no parallelism), then the same
windows through ``SequenceParallel`` — DeepSpeed's data loader adapter shards them, Ulysses runs
the patched attention — and the group's losses and gradients summed. Rank 0 writes
``{case: {"loss": [oracle, sp], "grad": max relative difference, ...}}`` to ``argv[1]``."""

import json
import sys

import torch
import torch.distributed as dist
import transformers as T

import ropescale
from ropescale.training.loop import causal_lm_loss
from ropescale.training.sequence_parallel import SequenceParallel, check_sequence_parallel

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, attention_dropout=0.0)
S, B = 32, 2  # window, windows per micro-batch
POSE = torch.tensor([list(range(12)) + list(range(40, 60))] * B)  # a PoSE-like jump: positions 0…11, 40…59

CASES = {  # name: (config class, model class, config overrides, strategy, parameters, position_ids)
    "yarn+logn, PoSE positions": (T.LlamaConfig, T.LlamaForCausalLM, {}, "yarn",
                                  {"factor": 4.0, "logn": True}, POSE),
    "rerope": (T.LlamaConfig, T.LlamaForCausalLM, {}, "rerope", {"window": 8}, None),
    "dca": (T.LlamaConfig, T.LlamaForCausalLM, {}, "dca", {"chunk_size": 12, "local_window": 4}, None),
    "self_extend, NoPE layers (SmolLM3)": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {"no_rope_layer_interval": 2},
                                           "self_extend", {"group_size": 4, "window": 8}, None),
    "linear, NoPE layers (SmolLM3)": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {"no_rope_layer_interval": 2},
                                      "linear", {"factor": 2.0}, None),
    "rerope, sliding-window hybrid (Gemma 3)": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                                                {"head_dim": 16, "sliding_window": 8,
                                                 "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
                                                "rerope", {"window": 8}, None),
}


def build(case):
    cfg_cls, model_cls, extra, strategy, params, _ = case
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL, **extra}))
    ropescale.patch(model, strategy, original_max_position_embeddings=16, **params)
    return model.train()


def shards_by_hand(windows, pos, rank):
    """Both batches' shards of this rank, cut here: tokens rank·S/2 … (rank + 1)·S/2 − 1, labels shifted."""
    lo, hi = rank * S // 2, (rank + 1) * S // 2
    for batch in windows:
        p = pos if pos is not None else torch.arange(S).expand(B, S)
        labels = torch.cat((batch[:, 1:], torch.full((B, 1), -100)), 1)
        yield {"input_ids": batch[:, lo:hi], "position_ids": p[:, lo:hi], "shift_labels": labels[:, lo:hi]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, case in CASES.items():
        torch.manual_seed(1)
        windows = torch.randint(0, SMALL["vocab_size"], (2, B, S))  # batch 0 is rank 0's, batch 1 rank 1's
        pos = case[5]
        model = build(case)
        check_sequence_parallel(2, config=model.config, kind=ropescale.get_strategy(case[3]).kind, window=S,
                                pose=pos is not None, attn_implementation=model.config._attn_implementation)
        oracle = []
        for batch in windows:  # whole windows, one process
            model.zero_grad()
            loss = causal_lm_loss(model, {"input_ids": batch, **({"position_ids": pos} if pos is not None else {})},
                                  chunk_size=8)
            loss.backward()
            oracle.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        sp = SequenceParallel(model, 2, micro_batch_size=B)
        mine = [{"input_ids": windows[rank], **({"position_ids": pos} if pos is not None else {})}]
        got = []
        try:
            for micro in sp.shard(mine, torch.device("cpu")):  # rank 0's batch, then rank 1's, each sharded
                model.zero_grad()
                loss = sp.loss(model, micro, chunk_size=8)
                loss.backward()
                total = loss.detach().clone()
                dist.all_reduce(total)
                grads = {}
                for n, p in model.named_parameters():
                    g = p.grad.clone()
                    dist.all_reduce(g)
                    grads[n] = g
                got.append((total.item(), grads))
        finally:
            sp.close()
        assert len(got) == 2, len(got)
        # the control: the same shards with the exchange undone (each process attends within its shard)
        alone = []
        for micro in shards_by_hand(windows, pos, rank):
            model.zero_grad()
            loss = sp.loss(model, micro, chunk_size=8)
            loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                g = p.grad.clone()
                dist.all_reduce(g)
                grads[n] = g
            alone.append(grads)
        results[name] = {
            "loss": [[o[0], g[0]] for o, g in zip(oracle, got)],
            "grad": max(rel(g[1][n], o[1][n]) for o, g in zip(oracle, got) for n in o[1]),
            "attention": model.config._attn_implementation,
            "grad_without_exchange": max(rel(a[n], o[1][n]) for a, o in zip(alone, oracle) for n in o[1]),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
