"""Query temperature: queries multiplied by a factor of their own position, the family log-n belongs to.

Each rule maps positions ``[b, s]`` (the queries', as ``position_ids`` gives them) to factors ``[b, s]``
float32 that multiply the queries before attention, so attention logits grow with the query's
position past the training window and attention entropy stays bounded. A factor depends on the
query's own absolute position only, never on the sequence length, so cached decoding is exact.

Notation: p = query position [tokens], T = ``original_max_position_embeddings`` [tokens].

- ``logn`` — max(1, ln(p + 1) / ln T): Su 2023, "Scaling attention by log n" (bojone/rerope).
- ``llama4`` — 1 + ``attn_scale`` · ln(1 + ⌊(p + 1) / ``floor_scale``⌋): Llama 4's
  ``attn_temperature_tuning`` on its NoPE layers (transformers ``Llama4TextAttention``; defaults 0.1, 8192).
- ``beta`` — 1 + ``beta`` · ln(1 + ⌊p / T⌋): Mistral's ``llama_4_scaling_beta`` (transformers
  ``get_llama_4_attn_scale``, Ministral 3 / Mistral Large 3; default β 0.1).
- ``native`` — no rule of ropescale's: the model keeps the temperature its config ships, which every other
  strategy than ``native`` otherwise removes (``shipped``).

Models ship a query temperature in two ways (``shipped``): Mistral's ``llama_4_scaling_beta`` in
``rope_parameters`` (Ministral 3, Mistral 4: every layer, part of the rope recipe, so a strategy that
replaces the recipe removes it) and Llama 4's ``attn_temperature_tuning`` (its NoPE layers only, outside
RoPE: always kept).

Raises ``InvalidInput`` (one line) for an unknown rule or a bad parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ropescale.errors import InvalidInput

__all__ = ["NATIVE", "RULES", "Temperature", "parse_temperature", "shipped"]

NATIVE = "native"  # the temperature option that keeps the model's own (no rule of ropescale's)


def _logn(pos: torch.Tensor, train: int, **_) -> torch.Tensor:
    return (torch.log(pos + 1) / math.log(train)).clamp(min=1.0)


def _llama4(pos: torch.Tensor, train: int, *, attn_scale: float = 0.1, floor_scale: float = 8192.0) -> torch.Tensor:
    return torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def _beta(pos: torch.Tensor, train: int, *, beta: float = 0.1) -> torch.Tensor:
    return 1 + beta * torch.log(1 + torch.floor(pos / train))


RULES: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    "logn": (_logn, ()),
    "llama4": (_llama4, ("attn_scale", "floor_scale")),
    "beta": (_beta, ("beta",)),
}


@dataclass(frozen=True)
class Temperature:
    """One query-temperature rule: ``kind`` (a key of ``RULES``) and its ``params``."""

    kind: str
    params: dict[str, float] = field(default_factory=dict)

    def factor(self, position_ids: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
        """Factors ``[b, s]`` float32 for query positions ``[b, s]``."""
        fn, _ = RULES[self.kind]
        return fn(position_ids.float(), int(original_max_position_embeddings), **self.params)

    def spec(self) -> str:
        """``kind`` or ``kind:name=value,…``, what ``parse_temperature`` reads back."""
        if not self.params:
            return self.kind
        return self.kind + ":" + ",".join(f"{k}={v:g}" for k, v in sorted(self.params.items()))


def parse_temperature(value: Any) -> Temperature | None:
    """None/False → None; True → ``logn``; ``"native"`` → ``Temperature("native")`` (keep the model's own);
    ``"beta"``, ``"beta:beta=0.2"``, ``{"kind": "llama4", "attn_scale": 0.1}`` or a ``Temperature`` → that
    rule, its parameters checked (finite numbers > 0)."""
    if value is None or value is False:
        return None
    if value is True:
        return Temperature("logn")
    if value == NATIVE or (isinstance(value, Temperature) and value.kind == NATIVE):
        return Temperature(NATIVE)
    if isinstance(value, Temperature):
        return value
    if isinstance(value, str):
        kind, _, rest = value.partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            name, eq, number = item.partition("=")
            if not eq:
                raise InvalidInput(f"temperature {value!r}: write parameters as name=value ({item!r})")
            try:
                params[name.strip()] = float(number)
            except ValueError:
                raise InvalidInput(f"temperature {value!r}: {name.strip()}={number!r} is not a number") from None
    elif isinstance(value, dict):
        params = dict(value)
        kind = params.pop("kind", None)
        if not isinstance(kind, str):
            raise InvalidInput(f"temperature {value!r}: name its kind ({', '.join(RULES)})")
    else:
        raise InvalidInput(f"temperature {value!r}: give a kind ({', '.join(RULES)}), true for logn, or a mapping")
    kind = kind.strip()
    if kind not in RULES:
        raise InvalidInput(f"temperature {kind!r} unknown; choose one of {', '.join(RULES)}, or {NATIVE} to keep "
                           "the model's own")
    allowed = RULES[kind][1]
    for name, number in params.items():
        if name not in allowed:
            raise InvalidInput(f"temperature {kind}: unknown parameter {name!r}; it takes "
                               f"{', '.join(allowed) or 'none'}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
                or number <= 0:
            raise InvalidInput(f"temperature {kind}: {name}={number!r} must be a finite number > 0")
    return Temperature(kind, {k: float(v) for k, v in params.items()})


def shipped(config: Any, rotates: bool) -> Temperature | None:
    """The query temperature ``config`` (a text config) ships for a layer that rotates (``rotates``) or not:
    ``beta`` from ``rope_parameters["llama_4_scaling_beta"]`` (any layer type's; every layer of Ministral 3 and
    Mistral 4 applies it), ``llama4`` from Llama 4's ``attn_temperature_tuning`` (its NoPE layers), else None."""
    rp = getattr(config, "rope_parameters", None)
    for params in ([rp] if isinstance(rp, dict) else []) + [v for v in (rp or {}).values() if isinstance(v, dict)]:
        beta = params.get("llama_4_scaling_beta")
        if isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta > 0:
            return Temperature("beta", {"beta": float(beta)})
    if not rotates and getattr(config, "attn_temperature_tuning", False):
        return Temperature("llama4", {"attn_scale": float(getattr(config, "attn_scale", 0.1)),
                                      "floor_scale": float(getattr(config, "floor_scale", 8192))})
    return None
