"""Qwen3-MoE and Qwen2-MoE (the dense Qwen3 lives in base.py)."""

from __future__ import annotations

from mismatch_probe.engines.megatron.adapters.base import Qwen3Adapter
from mismatch_probe.engines.megatron.adapters.moe import MoeAdapter


class Qwen3MoeAdapter(MoeAdapter, Qwen3Adapter):
    """Qwen3 attention; softmax router, SwiGLU experts, no shared expert."""

    architectures = ("Qwen3MoeForCausalLM",)


class Qwen2MoeAdapter(MoeAdapter):
    """QKV bias, no q/k norm; softmax router plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    architectures = ("Qwen2MoeForCausalLM",)
    shared_expert = "shared_expert"

    def qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("qkv_bias", True))

    def shared_expert_kwargs(self, hf: dict) -> dict:
        return dict(
            moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
        )
