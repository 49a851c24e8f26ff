"""Run by a vLLM interpreter (not ropescale's): builds vLLM's own rotary module with ``get_rope`` for each
case on stdin ([{"config": config.json dict, "max_model_len": L}]) and prints, per case, the per-pair
frequency read from the cos/sin cache at position 1, the magnitude (the cache's cos at position 0)
and the cache length, as JSON. Imports only vLLM and torch."""

import json
import sys
import types

import torch
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers import rotary_embedding as re_mod
from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as phi3


def probe(config: dict, max_model_len: int) -> dict:
    rp = config["rope_parameters"]
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    mpe = config["max_position_embeddings"]
    fake = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=max_model_len))
    phi3.get_current_vllm_config = lambda: fake  # LongRoPE reads max_model_len from the running config
    re_mod._ROPE_DICT.clear()
    rope = re_mod.get_rope(head, mpe, True, rp, torch.float32)
    if hasattr(rope, "long_short_cos_sin_cache"):
        cache = rope.long_short_cos_sin_cache
        t = rp["original_max_position_embeddings"]
        cache = cache[t:] if rope.use_long_rope else cache[:t]
    else:
        cache = rope.cos_sin_cache
    half = cache.shape[1] // 2
    cos, sin = cache[:, :half].double(), cache[:, half:].double()
    magnitude = float(cos[0, 0])
    rough = torch.atan2(sin[1], cos[1])  # θ_i from position 1, then refined at the farthest position with p·θ_i < 3
    last = min(cache.shape[0], max_model_len) - 1
    p = torch.clamp((3.0 / rough).floor(), 1, last).long()
    idx = torch.arange(half)
    freq = torch.atan2(sin[p, idx], cos[p, idx]) / p
    return {"inv_freq": freq.tolist(), "magnitude": magnitude, "cache": int(cache.shape[0])}


def main() -> None:
    cases = json.load(sys.stdin)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        out = [probe(c["config"], c["max_model_len"]) for c in cases]
    print("PROBE" + json.dumps(out))


if __name__ == "__main__":
    main()
