"""Attention-side kernels, plugged in through transformers' ``AttentionInterface``.

- ``interface``: the attention functions registered with transformers (log-n query scaling, the
  relative-position rules) and their per-model state;
- ``truncated``: the relative-position rules' paths (naive n × n oracle, blocked, fused) and the router;
- ``regions``: the fused CPU flash kernels over a rule's regions, with backward;
- ``flex``: the same regions in FlexAttention (compiled on CUDA);
- ``local``: the model's own attention with sliding windows at O(n·w), without n × n masks (CPU).

The public names of ``interface`` are re-exported here.
"""

from ropescale.attention.interface import (
    ATTENTION_PATHS,
    AttentionNotPluggableError,
    check_routed,
    enable_logn,
    enable_truncation,
    logn_factor,
    register_logn,
    reusable_prefix,
)

__all__ = ["ATTENTION_PATHS", "AttentionNotPluggableError", "check_routed", "enable_logn",
           "enable_truncation", "logn_factor", "register_logn", "reusable_prefix"]
