"""MLX driver: runs inside mlx-lm's own environment (never imports ropescale).

    python mlx_driver.py REQUEST.json RESULT.json

Modes (``request["mode"]``):

``rope``: ``{"cases": [{"model": DIR, "length": L, "layer_type": T | null}, ...]}`` → per case
``{"class": name, "layer": i, "cos": [[...]], "sin": [[...]]}``: mlx-lm's own model built from the folder's
config.json (``mlx_lm.utils.load_config`` and the model class ``_get_classes`` picks; its weights are
never evaluated), the rotary module of the first layer of type T (by the layer's ``layer_type``:
gemma4_text; else gemma3_text's ``is_sliding``: a sliding layer for ``sliding_attention``, a global one
otherwise; T null: layer 0), at that layer's ``head_dim``, applied to unit vectors at
positions 0 … L−1: ``cos[m][i]`` = magnitude·cos(angle of pair i at position m) (pairs i, i + d/2);
``"positions": [0, 1, …]`` in a case measures only those (the rows of ``cos``/``sin``, echoed in the
answer). ``{"error": line}`` for a case mlx-lm refuses.

``logprobs``: ``{"jobs": [{"model": DIR, "ids": [[int, ...], ...]}, ...]}`` → ``{"jobs": [{"logprobs":
[[float, ...], ...], "seconds": s} | {"error": line}, ...], "mlx": version}``: ``mlx_lm.utils.load_model``
of the folder, one forward per sequence (float32), ``logprobs[k][j]`` = log p(ids[j+1] | ids[:j+1])
(log-softmax in float64, ``CHUNK`` positions at a time: a 262k vocabulary at 2k tokens is 4 GiB per float64 copy).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

CHUNK = 256  # rows of the [n, V] logits turned into float64 log-probabilities at a time


def _version() -> str:
    import mlx.core as mx
    import mlx_lm

    return f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__})"


def _layers(model):
    inner = getattr(model, "model", None) or getattr(model, "language_model", None) or model
    inner = getattr(inner, "model", inner)
    return inner.layers


def _layer_index(layers, layer_type: str | None) -> int:
    """The first layer of type ``layer_type``: by its ``layer_type`` (gemma4_text's attention), else by
    ``is_sliding`` (gemma3_text: ``sliding_attention`` or any other); layer 0 without a type."""
    if not layer_type:
        return 0
    for i, layer in enumerate(layers):
        if getattr(layer.self_attn, "layer_type", getattr(layer, "layer_type", None)) == layer_type:
            return i
    sliding = layer_type == "sliding_attention"
    return next((i for i, layer in enumerate(layers) if bool(getattr(layer.self_attn, "is_sliding", False)) == sliding),
                0)


def _rotate(rope, d: int, n: int, offset: int):
    """``[n, d]``: the rotary module applied to the unit vectors of every pair's first channel at
    positions offset … offset + n − 1: cos in the first d/2 columns, sin in the last (magnitude-scaled).
    A ``traditional`` module (Llama 4's) pairs channels 2i and 2i + 1, the others i and i + d/2."""
    import mlx.core as mx
    import numpy as np

    if getattr(rope, "traditional", False):
        x = mx.stack([mx.ones((1, 1, n, d // 2)), mx.zeros((1, 1, n, d // 2))], axis=-1).reshape(1, 1, n, d)
        y = np.array(rope(x, offset=offset).astype(mx.float32))[0, 0].reshape(n, d // 2, 2)
        return np.concatenate([y[..., 0], y[..., 1]], axis=-1)
    x = mx.concatenate([mx.ones((1, 1, n, d // 2)), mx.zeros((1, 1, n, d // 2))], axis=-1)
    return np.array(rope(x, offset=offset).astype(mx.float32))[0, 0]


def rope(request: dict) -> dict:
    """Per case (an exported folder, L, a layer type): mlx-lm's own rotary module of that layer type applied to
    unit vectors at positions 0 … L−1, as cos and sin tables (see the module docstring)."""
    import numpy as np
    from mlx_lm.utils import _get_classes, load_config

    out = []
    for case in request["cases"]:
        try:
            config = load_config(Path(case["model"]))
            model_class, args_class = _get_classes(config)
            model = model_class(args_class.from_dict(config))
            layers = _layers(model)
            idx = _layer_index(layers, case.get("layer_type"))
            attn = layers[idx].self_attn
            d = getattr(attn, "head_dim", None) or config.get("head_dim") or config.get("qk_rope_head_dim") or (
                config["hidden_size"] // config["num_attention_heads"])
            positions = case.get("positions") or list(range(int(case["length"])))
            dense = next((k for k, p in enumerate(positions) if p != k), len(positions))  # 0 … dense−1 at once
            parts = [_rotate(attn.rope, d, dense, 0)] + [_rotate(attn.rope, d, 1, p) for p in positions[dense:]]
            y = np.concatenate(parts, axis=0)
            # DeepSeek's attention folds mscale² into its scale (deepseek_v3.py): the factor on q_head_dim^-½
            softmax = float(attn.scale * attn.q_head_dim ** 0.5) if hasattr(attn, "q_head_dim") else 1.0
            out.append({"class": type(attn.rope).__name__, "layer": idx, "cos": y[:, : d // 2].tolist(),
                        "sin": y[:, d // 2:].tolist(), "positions": positions, "softmax_scale": softmax})
        except Exception as e:  # noqa: BLE001 — mlx-lm refusing a config is a result
            out.append({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"})
    return {"cases": out, "mlx": _version()}


def logprobs(request: dict) -> dict:
    """Per job (an exported folder and token windows): mlx-lm's log-probability of each next token [nats]
    (float64 log-softmax, 256 positions at a time)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    out = []
    for job in request["jobs"]:
        start = time.perf_counter()
        try:
            model, _ = load_model(Path(job["model"]))
        except Exception as e:  # noqa: BLE001 — a refusal is a result, the next job still runs
            out.append({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                        "seconds": time.perf_counter() - start})
            continue
        rows = []
        for ids in job["ids"]:
            logits = np.array(model(mx.array([ids])).astype(mx.float32))[0]  # [n, V] float32
            row = []
            for a in range(0, len(ids) - 1, CHUNK):  # float64 log-softmax, CHUNK rows at a time: O(CHUNK·V) more memory
                part = logits[a:min(a + CHUNK, len(ids) - 1)].astype(np.float64)
                part -= part.max(-1, keepdims=True)
                lse = np.log(np.exp(part).sum(-1))
                row += [float(part[j, ids[a + j + 1]] - lse[j]) for j in range(part.shape[0])]
            rows.append(row)
        out.append({"logprobs": rows, "seconds": time.perf_counter() - start})
    return {"jobs": out, "mlx": _version()}


def main() -> None:
    """Read one JSON request on stdin (``mode``: rope or logprobs), write the JSON answer on stdout."""
    request = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    result = {"rope": rope, "logprobs": logprobs}[request["mode"]](request)
    Path(sys.argv[2]).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
