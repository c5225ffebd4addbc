"""HF checkpoint -> megatron-core GPTModel, one small adapter per model family.

`ADAPTERS` maps each HF architecture we can build to its adapter; `NOT_BUILDABLE` names what
megatron-core 0.16.1 (or our mapping) lacks for the MoE families it cannot build.
"""

from __future__ import annotations

from mismatch_probe.engines.megatron.adapters.base import DenseAdapter, Qwen3Adapter
from mismatch_probe.engines.megatron.adapters.checkpoint import read_hf_config
from mismatch_probe.engines.megatron.adapters.deepseek_v3 import DeepseekV3Adapter
from mismatch_probe.engines.megatron.adapters.glm4_moe import Dots1Adapter, Glm4MoeAdapter
from mismatch_probe.engines.megatron.adapters.gpt_oss import GptOssAdapter
from mismatch_probe.engines.megatron.adapters.mixtral import MixtralAdapter
from mismatch_probe.engines.megatron.adapters.qwen import Qwen2MoeAdapter, Qwen3MoeAdapter
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo

ADAPTERS: dict[str, type[DenseAdapter]] = {
    arch: cls
    for cls in (
        Qwen3Adapter,
        Qwen3MoeAdapter,
        Qwen2MoeAdapter,
        MixtralAdapter,
        DeepseekV3Adapter,
        Glm4MoeAdapter,
        Dots1Adapter,
        GptOssAdapter,
    )
    for arch in cls.architectures
}

NOT_BUILDABLE = {
    "OlmoeForCausalLM": "q/k RMSNorm over all heads together (megatron-core's qk_layernorm is per head)",
    "Qwen3NextForCausalLM": "gated DeltaNet linear-attention layers (megatron-core 0.16.1 builds them only with "
    "the flash-linear-attention package)",
    "Llama4ForCausalLM": "not mapped yet (top-1 sigmoid router scaling the expert input, chunked attention, "
    "NoPE layers)",
    "Ernie4_5_MoeForCausalLM": "softmax router with a selection bias (moe_statics; megatron-core's expert bias "
    "needs sigmoid scores)",
    "HunYuanMoEV1ForCausalLM": "q/k RMSNorm after the rotary embedding (megatron-core normalises before it) "
    "and NTK-alpha RoPE",
}


def adapter_for(model: ModelInfo) -> DenseAdapter:
    """The adapter for this checkpoint; exit 2 naming what is missing when megatron cannot build it."""
    where = model.path / "config.json"
    if model.architecture in NOT_BUILDABLE:
        raise ProbeError(
            f"{where}: architecture '{model.architecture}' is not supported by the megatron engine: "
            f"{NOT_BUILDABLE[model.architecture]}"
        )
    if model.architecture not in ADAPTERS:
        raise ProbeError(
            f"{where}: architecture '{model.architecture}' is not supported by the megatron engine "
            f"(supported: {', '.join(sorted(ADAPTERS))})"
        )
    adapter = ADAPTERS[model.architecture]()
    missing = adapter.missing_feature(read_hf_config(model))
    if missing:
        raise ProbeError(
            f"{where}: architecture '{model.architecture}' with {missing} is not supported by the megatron engine"
        )
    return adapter


__all__ = ["ADAPTERS", "NOT_BUILDABLE", "adapter_for", "read_hf_config"]
