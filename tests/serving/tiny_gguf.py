"""A minimal valid GGUF for a tiny Llama (llama architecture keys, a byte-level vocabulary and a few
weights of mixed types), written with gguf-py's GGUFWriter — enough for round trips, not a converter."""

from __future__ import annotations

import numpy as np


def write_tiny_llama_gguf(path, config, *, extra_kv=None, extra_tensors=None):
    """Write ``path``: the llama keys of a transformers ``LlamaConfig``, its rope base (and any
    ``extra_kv`` {key: (value, GGUFValueType)}), and tensors in F32 and F16."""
    import gguf

    head_dim = config.hidden_size // config.num_attention_heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_rope_scaling_finetuned(False)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    w.add_token_types([1] * config.vocab_size)
    w.add_bos_token_id(1)
    w.add_key_value("tiny.answer", 42, gguf.GGUFValueType.INT64)
    w.add_key_value("tiny.weights", [0.5, 1.5], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(config.hidden_size, dtype=np.float32))
    for i in range(config.num_hidden_layers):
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     rng.standard_normal((config.hidden_size, config.hidden_size)).astype(np.float16))
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_gemma3_gguf(path, config, *, sliding_window=True, freq_base_swa=True, extra_kv=None):
    """Write ``path``: the gemma3 keys llama.cpp's converter writes for a transformers
    ``Gemma3TextConfig`` (conversion/gemma.py: ``rope.freq_base`` the full_attention base,
    ``rope.freq_base_swa`` the sliding one, ``attention.sliding_window``; each of the last two left out
    when False), any ``extra_kv`` {key: (value, GGUFValueType)}, and two F32 tensors."""
    import gguf

    rp = config.rope_parameters
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_name("tiny-gemma3")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(float(rp["full_attention"]["rope_theta"]))
    if freq_base_swa:
        w.add_rope_freq_base_swa(float(rp["sliding_attention"]["rope_theta"]))
    if sliding_window:
        w.add_sliding_window(config.sliding_window)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(config.hidden_size, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
