"""The tiny Llama the authors' code and ropescale are both run on (``record.py`` and the tests): its
config as plain numbers and its weights from a fixed generator, so the same model is built under the
authors' pinned transformers (4.4x) and the one installed here (5.x). Imports torch only."""

from __future__ import annotations

import zlib

import torch

CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
T = CONFIG["max_position_embeddings"]  # the training window [tokens]


def weights(names_shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Float64 weights by parameter name: norms 1 + N(0, 0.1²), every other tensor N(0, 0.15²) — each from
    its own ``torch.Generator`` seeded by the CRC-32 of its name (so independent of the order and of any
    library's initialiser)."""
    out = {}
    for name, shape in names_shapes:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = 1 + 0.1 * x if "norm" in name else 0.15 * x
    return out


def load(model) -> object:
    """``model`` (a transformers ``LlamaForCausalLM`` built from ``CONFIG``) in float64 with ``weights``."""
    model = model.double().eval()
    state = weights([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    model.load_state_dict(state, strict=False)  # rotary buffers are not parameters
    return model


def ids(n: int, seed: int = 7) -> torch.Tensor:
    """``[1, n]`` token ids from a fixed generator."""
    return torch.randint(0, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))
