"""What the census finds wrong today, by cause: ``KNOWN = {type: {check: reason}}``.

``tests/test_census.py`` runs each entry as a strict xfail: when a fix makes the check pass it
XPASSes, which fails until the entry is removed. Each reason names the rotary contract the
family breaks and where transformers 5.24 shows it (``models/<type>/modeling_<type>.py:<line>``;
5.25 has the same lines) or where ropescale trips over it; paths are relative to the installed
``transformers`` package. The table holds on the locked transformers (5.24) and on the newest release
the range admits (5.25: the types it adds build and pass, Kolibri 1.1 through a builder override), which
CI's compatibility job runs the census on.

Every rotary contract the census found broken before issue 27 (NoPE layers rotated, interleaved or
mirrored pairs decided in attention, M-RoPE, MLA's v_head_dim, DSA indexers, complex freqs_cis,
attention without position_ids, proportional RoPE, shipped query temperature, ...) is fixed; the
table as it stood is docs/architectures-before.md. What is left: types the census cannot build.
"""

from __future__ import annotations

__all__ = ["CAUSES", "KNOWN"]

RULE_CHECKS = ("rerope", "leaky_rerope", "self_extend", "string", "dca")
FREQUENCY_CHECKS = ("vanilla", "linear", "yarn", "dynamic_ntk")

# --- causes ------------------------------------------------------------------------------------
NOT_STANDALONE = ("not a standalone causal LM: a draft model whose forward needs the target model's "
                  "shared_kv_states (models/{name}/modeling_{name}.py:{line}); the census builds models alone{also}")
NEEDS_TIMM = "needs the timm package for its vision tower (TimmWrapperModel), not installed in CI"
NOT_BUILDABLE = "the census cannot build it from its config class: {why}"

CAUSES = {k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)}

KNOWN: dict[str, dict[str, str]] = {
    # types the census does not build
    "gemma3n": {"build": NEEDS_TIMM},
    "gemma4_assistant": {"build": NOT_STANDALONE.format(
        name="gemma4_assistant", line=166, also="; its class default config fails its own validation, "
        "hidden_size_per_layer_input must be 0 (configuration_gemma4_assistant.py:86)")},
    "gemma4_unified_assistant": {"build": NOT_STANDALONE.format(name="gemma4_unified_assistant", line=173, also="")},
    "mamba2": {"build": NOT_BUILDABLE.format(why="the forward fails in repeat_interleave (its grouped SSM heads "
                                                 "need more than the generic shrink; no RoPE, so no override)")},
    "musicgen": {"build": NOT_BUILDABLE.format(why="the causal LM reads num_codebooks rows of ids per sequence "
                                                   "(no RoPE)")},
    "musicgen_melody": {"build": NOT_BUILDABLE.format(why="as MusicGen (no RoPE)")},
    "reformer": {"build": NOT_BUILDABLE.format(why="axial position embeddings must factor the sequence and hidden "
                                                   "sizes (no RoPE)")},
    "xmod": {"build": NOT_BUILDABLE.format(why="X-MOD needs set_default_language() before a forward (no RoPE)")},
    "zamba": {"build": NOT_BUILDABLE.format(why="its shared-transformer weight tying assumes the default layer "
                                                "pattern (no RoPE)")},
}
