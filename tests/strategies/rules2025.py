"""Shared checks of the 2025 training-free rules (DPE, LaMPE): the authors' goldens and the tiny
Llama they were recorded on (``tests/data/authors/``), the float64 kernel oracle with gradients, and the
refusals of every serving engine with one static rotation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale.attention.relative import blocked_attention, fused_attention, naive_attention
from tests.data.authors import tiny

AUTHORS = Path(__file__).resolve().parents[1] / "data" / "authors"


def golden(rule: str) -> tuple[dict, dict]:
    """The recorded golden of ``rule`` (``tests/data/authors/<rule>.pt``) and its provenance (``.json``)."""
    return torch.load(AUTHORS / f"{rule}.pt"), json.loads((AUTHORS / f"{rule}.json").read_text())


def tiny_llama():
    """``tests/data/authors/tiny.py``'s Llama under the installed transformers, float64, as the goldens'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in tiny.CONFIG.items() if k != "rope_theta"}
    return tiny.load(LlamaForCausalLM(LlamaConfig(**cfg, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": tiny.CONFIG["rope_theta"]})))


def inputs(b: int, n_h: int, n_kv: int, s_q: int, s_k: int, h_d: int, seed: int):
    """Float64 q ``[b, n_h, s_q, h_d]``, k, v ``[b, n_kv, s_k, h_d]`` requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_h, s_q, h_d, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(b, n_kv, s_k, h_d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    return q, k, v


def softmax_attention(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax over j ≤ i (causal by slot, the last query the last key) of ``logits`` ``[b, h, s_q, s_k]``
    (already scaled), times v ``[b, h, s_k, h_v]``."""
    s_q, s_k = logits.shape[-2:]
    causal = torch.arange(s_k)[None, :] <= torch.arange(s_k - s_q, s_k)[:, None]
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ v


def pair_logits(q, k, p: torch.Tensor, inv: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """RoPE logits q·R(p)k (rotate-half layout) with a relative position per query, key and rotary pair:
    p ``[s_q, s_k, d/2]`` float64 [tokens], q ``[b, h, s_q, h_d]``, k ``[b, h, s_k, h_d]``; channels past d
    plain; cos and sin × ``factor`` → ``[b, h, s_q, s_k]`` (unscaled)."""
    d = 2 * inv.numel()
    q1, q2, k1, k2 = q[..., : d // 2], q[..., d // 2 : d], k[..., : d // 2], k[..., d // 2 : d]
    ang = p * inv.double()  # [s_q, s_k, d/2]
    a = q1[..., :, None, :] * k1[..., None, :, :] + q2[..., :, None, :] * k2[..., None, :, :]
    b = q1[..., :, None, :] * k2[..., None, :, :] - q2[..., :, None, :] * k1[..., None, :, :]
    return (a * ang.cos() + b * ang.sin()).sum(-1) * factor**2 + q[..., d:] @ k[..., d:].transpose(-1, -2)


def close_grads(got, want, rtol: float) -> float:
    """Largest gradient difference relative to the largest gradient entry; asserts it is ≤ ``rtol``."""
    scale = max(float(w.abs().max()) for w in want)
    worst = max(float((a - w).abs().max()) for a, w in zip(got, want, strict=True)) / scale
    assert worst <= rtol, worst
    return worst


def paths_match_oracle(rule, oracle_out, q, k, v, q_pos, k_pos, inv, *, scale: float, tol: float,
                       factor: float = 1.0) -> None:
    """Every kernel path (fused with its backward, blocked, naive) against an oracle output computed by
    autograd from q, k, v: outputs within ``tol`` and q, k, v gradients within ``tol`` of the largest."""
    g = torch.randn(oracle_out.shape, generator=torch.Generator().manual_seed(1), dtype=oracle_out.dtype)
    want = torch.autograd.grad(oracle_out, (q, k, v), g, retain_graph=True)
    for path in (fused_attention, blocked_attention, naive_attention):
        kw = {"block": 8} if path is blocked_attention else {}
        out = path(q, k, v, q_pos, k_pos, rule, inv, factor, scale=scale, **kw)
        assert (out - oracle_out).abs().max() <= tol, (path.__name__, float((out - oracle_out).abs().max()))
        close_grads(torch.autograd.grad(out, (q, k, v), g), want, tol)


def refused_by_static_engines(name: str, params: dict) -> list[str]:
    """Patch the tiny Llama with ``name`` and translate it for every engine serving one static rotation
    (vLLM, llama.cpp, MLX, SGLang, any plugin's): each refuses in one line naming itself and the rule as a
    relative-position rule. Returns the engines checked."""
    from ropescale.serving.engines import engine_names, get_engine
    from ropescale.serving.rope import ExportRefused

    checked = []
    with ropescale.patch(tiny_llama(), name, **params) as handle:
        for engine in map(get_engine, engine_names()):
            if not engine.static:
                continue
            with pytest.raises(ExportRefused) as refused:
                engine.translate(handle, 256)
            line = str(refused.value)
            assert "\n" not in line and line.startswith(f"{engine.label}:") and "relative-position rule" in line, line
            checked.append(engine.name)
    return checked


def assert_fused_grads_equal_naive(model, rule: str, ids: torch.Tensor, **params) -> None:
    """One training step's gradients of every parameter through the fused path equal the naive path's
    (``rule`` patched with ``params``; ≤ 1e-5 of each gradient's largest entry)."""
    grads = {}
    for path in ("fused", "naive"):
        model.zero_grad()
        with ropescale.patch(model, rule, attention_path=path, **params):
            model(ids, labels=ids).loss.backward()
        grads[path] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["naive"].items():
        assert (grads["fused"][name] - g).abs().max() <= 1e-5 * g.abs().max(), name
