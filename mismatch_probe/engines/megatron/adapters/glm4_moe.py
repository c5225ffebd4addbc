"""DeepSeek-V3-style MoE under GQA attention: GLM-4.5 / 4.6 (QKV bias, optional per-head q/k
RMSNorm, partial rotary embedding) and dots1 (Qwen3 attention)."""

from __future__ import annotations

from mismatch_probe.engines.megatron.adapters.base import Qwen3Adapter, rope_parameters
from mismatch_probe.engines.megatron.adapters.sigmoid_routing import SigmoidRoutedAdapter


class Glm4MoeAdapter(SigmoidRoutedAdapter):
    architectures = ("Glm4MoeForCausalLM",)

    def qk_layernorm(self, hf: dict) -> bool:
        return bool(hf.get("use_qk_norm", False))

    def rotary_percent(self, hf: dict) -> float:
        # transformers' Glm4MoeConfig defaults partial_rotary_factor to 0.5.
        return float(rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))


class Dots1Adapter(SigmoidRoutedAdapter, Qwen3Adapter):
    architectures = ("Dots1ForCausalLM",)
