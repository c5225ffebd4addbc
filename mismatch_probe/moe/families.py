"""The table of MoE families: which router style each uses, how its config says which layers are MoE."""

from __future__ import annotations

from . import layers
from .base import RoutingAdapter
from .sigmoid_bias import SigmoidWithBias
from .sigmoid_dense import SigmoidDenseScores
from .softmax_of_topk import SoftmaxOfTopK
from .softmax_topk import SoftmaxTopK

_SOFTMAX = SoftmaxTopK("flag")
_SIGMOID = SigmoidWithBias()

ADAPTERS: tuple[RoutingAdapter, ...] = (
    RoutingAdapter("Qwen3-MoE", ("qwen3_moe",), ("Qwen3MoeTopKRouter",), _SOFTMAX,
                   "num_experts", "num_experts_per_tok", layers.sparse_step, megatron=True, megatron_r3=True),
    RoutingAdapter("Qwen2-MoE", ("qwen2_moe",), ("Qwen2MoeTopKRouter",), _SOFTMAX,
                   "num_experts", "num_experts_per_tok", layers.sparse_step, megatron=True, megatron_r3=True),
    RoutingAdapter("Qwen3-Next", ("qwen3_next",), ("Qwen3NextTopKRouter",), _SOFTMAX,
                   "num_experts", "num_experts_per_tok", layers.sparse_step),
    RoutingAdapter("Mixtral", ("mixtral",), ("MixtralTopKRouter",), SoftmaxTopK("always"),
                   "num_local_experts", "num_experts_per_tok", layers.every_layer, megatron=True, megatron_r3=True),
    RoutingAdapter("OLMoE", ("olmoe",), ("OlmoeTopKRouter",), _SOFTMAX,
                   "num_experts", "num_experts_per_tok", layers.every_layer),
    RoutingAdapter("DeepSeek-V3 / Kimi-K2", ("deepseek_v3", "kimi_k2"), ("DeepseekV3TopkRouter",), _SIGMOID,
                   "n_routed_experts", "num_experts_per_tok", layers.after_first_k_dense, megatron=True, megatron_r3=True),
    RoutingAdapter("GLM-4.5", ("glm4_moe",), ("Glm4MoeTopkRouter",), _SIGMOID,
                   "n_routed_experts", "num_experts_per_tok", layers.after_first_k_dense, megatron=True, megatron_r3=True),
    RoutingAdapter("dots1", ("dots1",), ("Dots1TopkRouter",), _SIGMOID,
                   "n_routed_experts", "num_experts_per_tok", layers.after_first_k_dense, megatron=True, megatron_r3=True),
    RoutingAdapter("gpt-oss", ("gpt_oss",), ("GptOssTopKRouter",), SoftmaxOfTopK(),
                   "num_local_experts", "num_experts_per_tok", layers.every_layer, megatron=True, megatron_r3=True),
    RoutingAdapter("Llama-4 (text)", ("llama4_text", "llama4"), ("Llama4Router",), SigmoidDenseScores(),
                   "num_local_experts", "num_experts_per_tok", layers.interleaved),
    RoutingAdapter("ERNIE-4.5-MoE", ("ernie4_5_moe",), ("Ernie4_5_MoeTopKRouter",), SoftmaxTopK("clamped"),
                   "moe_num_experts", "moe_k", layers.start_end_interval),
    RoutingAdapter("Hunyuan-MoE-V1", ("hunyuan_v1_moe",), ("HunYuanMoEV1Gate",), SoftmaxTopK("always"),
                   "num_experts", "moe_topk", layers.every_layer),
)

# Model types transformers does not register, loaded with the config class of the architecture they are.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}

# config.json keys that mean "this model has experts", whatever the family calls them.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def adapter_for(model_type: str) -> RoutingAdapter | None:
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    return None


def adapter_named(family: str | None) -> RoutingAdapter | None:
    return next((adapter for adapter in ADAPTERS if adapter.family == family), None)


def supported_names() -> str:
    return ", ".join(a.family for a in ADAPTERS)
