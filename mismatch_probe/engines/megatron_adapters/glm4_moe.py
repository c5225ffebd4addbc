"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): DeepSeek-V3-style MoE under GQA attention with QKV bias,
optional per-head q/k RMSNorm and partial rotary embedding."""

from __future__ import annotations

from .base import rope_parameters
from .sigmoid_routing import SigmoidRoutedAdapter


class Glm4MoeAdapter(SigmoidRoutedAdapter):
    architectures = ("Glm4MoeForCausalLM",)

    def qk_layernorm(self, hf: dict) -> bool:
        return bool(hf.get("use_qk_norm", False))

    def rotary_percent(self, hf: dict) -> float:
        # transformers' Glm4MoeConfig defaults partial_rotary_factor to 0.5.
        return float(rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
