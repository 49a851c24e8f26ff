"""Tiny random models of every RoPE family ropescale supports, built from configs (no downloads)."""

import copy

import torch
import transformers as T

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

FAMILIES = {  # name: (config class, model class, extra config)
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
    # explicit head_dim: transformers 5.23 dynamic/yarn read getattr(config, "head_dim", …), None for Mixtral
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM,
                {"num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 16}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {"head_dim": 16}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 32}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               {"head_dim": 16, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}),
    # Phi-3 keeps the training window at the top level of its config (4096 by default)
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM,
             {"pad_token_id": 0, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 32}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"partial_rotary_factor": 0.25}),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, {"num_kv_heads": 2, "new_decoder_architecture": True}),
    "olmo": (T.OlmoConfig, T.OlmoForCausalLM, {}),
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, {"partial_rotary_factor": 0.25}),
}


def family_config(name, **rope):
    """Config of ``name``; ``rope`` updates its rope parameters (Gemma 3: the full-attention ones)."""
    cfg_cls, _, extra = FAMILIES[name]
    base = cfg_cls(**COMMON, **extra).rope_parameters
    if not rope:
        return cfg_cls(**COMMON, **extra)
    if name == "gemma3":
        rp = {**base, "full_attention": {**base["full_attention"], **rope}}
    else:
        rp = {**base, **rope}
    return cfg_cls(**COMMON, **extra, rope_parameters=rp)


def family_model(name, state_dict=None, **rope):
    torch.manual_seed(0)
    model = FAMILIES[name][1](copy.deepcopy(family_config(name, **rope))).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model
