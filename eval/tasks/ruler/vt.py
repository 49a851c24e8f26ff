"""RULER's variable tracking, ``vt`` (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER ``c3f5e3b4``
``scripts/data/synthetic/variable_tracking.py`` with ``scripts/synthetic.yaml``'s ``vt``: noise
haystack, 1 chain of 4 hops): every variable holding a value, after one in-context example.
Prompts from ``vt_gen``; metric ``string_match_all``; 30 tokens generated."""

from __future__ import annotations

from pydantic import Field

from .base import RulerOptions, RulerTask
from .vt_gen import generate_vt

__all__ = ["VariableTracking", "VtOptions"]


class VtOptions(RulerOptions):
    """RULER vt's options (chains and hops, at RULER's defaults)."""

    num_chains: int = Field(1, ge=1, description="chains of assignments (RULER vt: 1)")
    num_hops: int = Field(4, ge=1, description="hops per chain (RULER vt: 4)")


class VariableTracking(RulerTask):
    """RULER vt: find every variable a chain of assignments gives a value."""

    name = "vt"
    family = "variable_tracking"
    Options = VtOptions

    def generate(self, length, num_samples):
        o = self.options
        return generate_vt(count=self.count, template=self.template, max_seq_length=length, num_samples=num_samples,
                           seed=o.seed, tokens_to_generate=self.budget, num_chains=o.num_chains, num_hops=o.num_hops,
                           what=self.name, max_draws=o.max_draws)
