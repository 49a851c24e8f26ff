"""The model's LM head applied to chunks of positions: next-token NLL and the training loss in
O(n·d) memory, never holding ``[n, V]`` logits.

A causal LM's forward ends ``logits = post(lm_head(hidden))``; at Llama 3's vocabulary
(V = 128,256) the logits of one 8k-token window are 4.2 GB in float32 per copy, and
``cross_entropy`` adds a log-softmax of the same size — at 128k tokens, ≈ 67 GB a copy. Here the
base model runs once per batch (transformers' own forward with ``logits_to_keep=1``, its last
hidden state captured by a forward hook on the decoder, so hooks, attention backends, DDP and
PEFT wrappers all see an ordinary call), then the head and the loss run over chunks of
positions in float32. The head is reproduced from what each family's forward does after
``lm_head`` — a bias or tied weights come with the module itself; Gemma 2/3
``final_logit_softcapping`` (tanh(l / c)·c), Cohere ``logit_scale`` (× s), Granite
``logits_scaling`` (÷ s), HyperCLOVAX ``logits_scaling`` (× s), Falcon-H1 ``lm_head_multiplier``
(× s) — and *checked* on the first batch against the model's own logits at the last position,
which the same forward returns for free. A head ropescale cannot reproduce (a
family with another post-processing step) fails that check: the caller then falls back to full
logits with a warning, never a silently different number.

Training (``causal_lm_loss``): each chunk's logits and loss run under non-reentrant activation
checkpointing, so backward recomputes them chunk by chunk; peak memory is one chunk's logits
and their gradient (Liger-Kernel's fused linear cross-entropy does the same in one kernel:
Hsu et al. 2024, arXiv:2410.10989).

Shapes: b = batch, n = positions, d = hidden size, V = vocabulary, c = positions per chunk.
NLL in nats.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_BUDGET", "HeadMismatchError", "OutputHead", "causal_lm_loss", "chunk_size_for"]

DEFAULT_BUDGET = 256 * 2**20  # bytes of per-chunk logits work (logits, their float copy, log-softmax, grad)
IGNORE = -100  # transformers' ignore index for labels


class HeadMismatchError(RuntimeError):
    """The reproduced head disagrees with the model's own logits."""


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP/FSDP (``.module``) and PEFT (``get_base_model()``) wrappers."""
    while True:
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, accelerate wrappers
            model = model.module
        else:
            return model


def _post_scale(inner: nn.Module, cfg) -> tuple[str, float] | None:
    """``("mul" | "div", value)`` a family's forward applies to ``lm_head``'s output, as its
    modeling file writes it (transformers 5.23); None for the others. A family not listed here
    that scales its logits fails ``OutputHead.check`` and is scored from full logits."""
    kind = getattr(cfg, "model_type", "") or ""
    if kind.startswith("granite"):  # logits / config.logits_scaling
        return "div", cfg.logits_scaling
    if kind.startswith("hyperclovax"):  # lm_head(h) * config.logits_scaling
        return "mul", cfg.logits_scaling
    if kind == "falcon_h1":  # lm_head(h) * self.model.lm_head_multiplier
        return "mul", inner.base_model.lm_head_multiplier
    if kind.startswith("cohere") and isinstance(getattr(inner, "logit_scale", None), (int, float)):
        return "mul", inner.logit_scale  # logits * self.logit_scale
    return None


def chunk_size_for(vocab_size: int, batch: int, *, budget: int = DEFAULT_BUDGET, training: bool = False,
                   dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk so that one chunk's logits work fits ``budget`` bytes: per position
    and row, V × (the head's output in ``dtype`` + its float32 copy unless it is float32 already
    + the log-softmax; + the logits' gradient in training). At least 1."""
    size = torch.finfo(dtype).bits // 8
    per_position = vocab_size * (size + (4 if size < 4 else 0) + 4 + (4 if training else 0))
    return max(1, budget // (per_position * max(1, batch)))


class OutputHead:
    """The LM head of ``model`` (a transformers causal LM, maybe inside DDP or PEFT wrappers).

    ``run(**inputs)`` → ``(hidden [b, n, d], own_logits [b, 1, V])``; ``logits(hidden [..., d])``
    → ``[..., V]``; ``check(hidden, own)`` compares the two at the last position.

    Raises ``ValueError`` when the model has no separate decoder or no output embeddings.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        inner = _unwrap(model)
        self.decoder = inner.base_model
        self.proj = inner.get_output_embeddings()
        if self.decoder is inner or self.proj is None:
            raise ValueError(f"{type(inner).__name__} has no separate decoder and LM head")
        cfg = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.scale = _post_scale(inner, cfg)
        self.vocab_size = self.proj.weight.shape[0]
        self.mismatch: str | None = None  # why the head could not be reproduced, once a check failed
        self.verified = False  # checked once: the head does not change while this object is used

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` → ``[..., V]`` as the model's own forward computes them (its dtype)."""
        x = self.proj(hidden)
        if self.scale is not None:
            op, value = self.scale
            x = x * value if op == "mul" else x / value
        if self.softcap:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def run(self, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the model with ``logits_to_keep=1``: the decoder's last hidden state
        ``[b, n, d]`` (captured by a forward hook) and the model's own logits ``[b, 1, V]``."""
        captured = []

        def hook(module, args, output):
            captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

        handle = self.decoder.register_forward_hook(hook)
        try:
            out = self.model(**inputs, logits_to_keep=1)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise HeadMismatchError(f"the decoder ran {len(captured)} times in one forward")
        return captured[0], out.logits

    @torch.no_grad()
    def check(self, hidden: torch.Tensor, own: torch.Tensor) -> str | None:
        """None when ``logits(hidden[:, -1:])`` equals the model's ``own`` ``[b, 1, V]`` element by
        element to 4 ulps of its dtype (both apply the same ops to the same slice, so they are
        normally bit-identical; a missing scale or cap is many ulps off on the large logits even
        in bfloat16); else why not."""
        mine = self.logits(hidden[:, -1:])
        if mine.shape != own.shape:
            return f"shape {tuple(mine.shape)} vs the model's {tuple(own.shape)}"
        ref = own.float()
        excess = (mine.float() - ref).abs() - 4 * torch.finfo(own.dtype).eps * ref.abs().clamp_min(1.0)
        if float(excess.max()) <= 0:
            return None
        return f"max |Δlogit| {float((mine.float() - ref).abs().max()):.3g} at the last position, over 4 ulps"

    def verify(self, hidden: torch.Tensor, own: torch.Tensor) -> bool:
        """Whether the chunked head may be used: ``check`` on the first call (one host read per
        head object, none per batch after it), its verdict kept. A mismatch warns once."""
        if not self.verified:
            self.verified = True
            self.mismatch = self.check(hidden, own)
            if self.mismatch is not None:
                warnings.warn(f"{type(_unwrap(self.model)).__name__}: the chunked LM head does not reproduce the "
                              f"model's logits ({self.mismatch}); using full [n, V] logits instead (more memory, "
                              "same numbers)", stacklevel=3)
        return self.mismatch is None

    def token_nll(self, hidden: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """NLL ``[b, n]`` float32 of ``targets`` ``[b, n]`` predicted from ``hidden`` ``[b, n, d]``
        (0 where the target is ``-100``), the head applied ``chunk`` positions at a time (default:
        ``chunk_size_for``)."""
        b, n = targets.shape
        chunk = chunk or chunk_size_for(self.vocab_size, b, dtype=hidden.dtype)
        parts = []
        for s in range(0, n, chunk):
            logits = self.logits(hidden[:, s : s + chunk]).float()  # [b, c, V]
            parts.append(F.cross_entropy(logits.flatten(0, 1), targets[:, s : s + chunk].flatten(),
                                         reduction="none", ignore_index=IGNORE).view(b, -1))  # [b, c]
        return torch.cat(parts, dim=1)

    def token_kl(self, reference: torch.Tensor, hidden: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """KL(P_reference ‖ P) ``[b, n]`` float32 [nats] of the next-token distributions the head
        gives at each position, from ``reference`` and ``hidden`` ``[b, n, d]`` (the same positions of
        two forwards), ``chunk`` positions at a time (default: half ``chunk_size_for``'s — two
        distributions a chunk). Σ_v p_ref(v) · (log p_ref(v) − log p(v)), in float32; a position whose
        two distributions are equal to rounding can come out a few ulps below 0, kept at 0."""
        b, n = hidden.shape[:2]
        chunk = chunk or max(1, chunk_size_for(self.vocab_size, b, dtype=hidden.dtype) // 2)
        parts = []
        for s in range(0, n, chunk):
            ref = F.log_softmax(self.logits(reference[:, s : s + chunk]).float(), dim=-1)  # [b, c, V]
            own = F.log_softmax(self.logits(hidden[:, s : s + chunk]).float(), dim=-1)  # [b, c, V]
            parts.append(F.kl_div(own, ref, reduction="none", log_target=True).sum(-1).clamp_min(0))  # [b, c]
        return torch.cat(parts, dim=1)


def _chunk_loss_sum(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head.logits(hidden).float()  # [b, c, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                   chunk_size: int | None = None, budget: int = DEFAULT_BUDGET,
                   head: OutputHead | None = None) -> torch.Tensor:
    """Mean next-token NLL [nats] of ``labels`` (default ``input_ids``) ``[b, n]``, shifted as
    transformers' loss does (position t predicts t + 1; ``-100`` ignored), from the decoder's
    hidden states with the head applied ``chunk_size`` positions at a time (default: from
    ``budget`` bytes) and recomputed in backward. Equal to ``model(..., labels=).loss`` to float
    noise; falls back to it (warning once per ``head``) when the head cannot be reproduced,
    which ``head.verify`` checks on its first batch. ``head``: an ``OutputHead(model)`` kept
    across calls (a training run builds one, so only its first step reads anything on the host).
    """
    labels = input_ids if labels is None else labels
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
              "use_cache": False}
    head = head or OutputHead(model)
    if head.mismatch is not None:
        return model(**inputs, labels=labels).loss
    hidden, own = head.run(**inputs)
    if not head.verify(hidden, own):
        return model(**inputs, labels=labels).loss
    targets = labels[:, 1:]  # [b, n-1]
    h = hidden[:, :-1]  # [b, n-1, d]
    b, n = targets.shape
    chunk = chunk_size or chunk_size_for(head.vocab_size, b, budget=budget, training=True, dtype=h.dtype)
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, n, chunk):
        part = (h[:, s : s + chunk], targets[:, s : s + chunk])
        if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.proj.parameters())):
            total = total + checkpoint(_chunk_loss_sum, head, *part, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, *part)
    count = (targets != IGNORE).sum()
    return total / count.clamp_min(1)
