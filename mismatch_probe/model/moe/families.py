"""The table of MoE families: which router style each uses, how its config says which layers are MoE."""

from __future__ import annotations

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.moe import layers
from mismatch_probe.model.moe.base import RoutingAdapter
from mismatch_probe.model.moe.sigmoid_bias import SigmoidWithBias
from mismatch_probe.model.moe.sigmoid_dense import SigmoidDenseScores
from mismatch_probe.model.moe.softmax_of_topk import SoftmaxOfTopK
from mismatch_probe.model.moe.softmax_topk import SoftmaxTopK

_SOFTMAX = SoftmaxTopK(renormalise="flag")
_SIGMOID = SigmoidWithBias()
# transformers 5.13: these families' routers return (logits, weights, experts), as the styles read them.
_TOPK_TUPLE = "5.13"

ADAPTERS: tuple[RoutingAdapter, ...] = (
    RoutingAdapter(
        family="Qwen3-MoE",
        model_types=("qwen3_moe",),
        block_classes=("Qwen3MoeSparseMoeBlock",),
        router_classes=("Qwen3MoeTopKRouter",),
        style=_SOFTMAX,
        num_experts_key="num_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.sparse_step,
        megatron=True,
        megatron_r3=True,
    ),
    RoutingAdapter(
        family="Qwen2-MoE",
        model_types=("qwen2_moe",),
        block_classes=("Qwen2MoeSparseMoeBlock",),
        router_classes=("Qwen2MoeTopKRouter",),
        style=_SOFTMAX,
        num_experts_key="num_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.sparse_step,
        megatron=True,
        megatron_r3=True,
    ),
    RoutingAdapter(
        family="Qwen3-Next",
        model_types=("qwen3_next",),
        block_classes=("Qwen3NextSparseMoeBlock",),
        router_classes=("Qwen3NextTopKRouter",),
        style=_SOFTMAX,
        num_experts_key="num_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.sparse_step,
    ),
    RoutingAdapter(
        family="Mixtral",
        model_types=("mixtral",),
        block_classes=("MixtralSparseMoeBlock",),
        router_classes=("MixtralTopKRouter",),
        style=SoftmaxTopK(renormalise="always"),
        num_experts_key="num_local_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.every_layer,
        megatron=True,
        megatron_r3=True,
    ),
    RoutingAdapter(
        family="OLMoE",
        model_types=("olmoe",),
        block_classes=("OlmoeSparseMoeBlock",),
        router_classes=("OlmoeTopKRouter",),
        style=_SOFTMAX,
        num_experts_key="num_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.every_layer,
    ),
    RoutingAdapter(
        family="DeepSeek-V3 / Kimi-K2",
        model_types=("deepseek_v3", "kimi_k2"),
        block_classes=("DeepseekV3MoE",),
        router_classes=("DeepseekV3TopkRouter",),
        style=_SIGMOID,
        num_experts_key="n_routed_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.after_first_k_dense,
        megatron=True,
        megatron_r3=True,
        min_transformers=_TOPK_TUPLE,
    ),
    RoutingAdapter(
        family="GLM-4.5",
        model_types=("glm4_moe",),
        block_classes=("Glm4MoeMoE",),
        router_classes=("Glm4MoeTopkRouter",),
        style=_SIGMOID,
        num_experts_key="n_routed_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.after_first_k_dense,
        megatron=True,
        megatron_r3=True,
        min_transformers=_TOPK_TUPLE,
    ),
    RoutingAdapter(
        family="dots1",
        model_types=("dots1",),
        block_classes=("Dots1MoE",),
        router_classes=("Dots1TopkRouter",),
        style=_SIGMOID,
        num_experts_key="n_routed_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.after_first_k_dense,
        megatron=True,
        megatron_r3=True,
        min_transformers=_TOPK_TUPLE,
    ),
    RoutingAdapter(
        family="gpt-oss",
        model_types=("gpt_oss",),
        block_classes=("GptOssMLP",),
        router_classes=("GptOssTopKRouter",),
        router_attr="router",
        style=SoftmaxOfTopK(),
        num_experts_key="num_local_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.every_layer,
        megatron=True,
        megatron_r3=True,
    ),
    RoutingAdapter(
        family="Llama-4 (text)",
        model_types=("llama4_text", "llama4"),
        block_classes=("Llama4TextMoe",),
        router_classes=("Llama4Router",),
        router_attr="router",
        style=SigmoidDenseScores(),
        num_experts_key="num_local_experts",
        top_k_key="num_experts_per_tok",
        moe_layers=layers.interleaved,
    ),
    RoutingAdapter(
        family="ERNIE-4.5-MoE",
        model_types=("ernie4_5_moe",),
        block_classes=("Ernie4_5_MoeSparseMoeBlock",),
        router_classes=("Ernie4_5_MoeTopKRouter",),
        style=SoftmaxTopK(renormalise="clamped"),
        num_experts_key="moe_num_experts",
        top_k_key="moe_k",
        moe_layers=layers.start_end_interval,
        min_transformers=_TOPK_TUPLE,
    ),
    RoutingAdapter(
        family="Hunyuan-MoE-V1",
        model_types=("hunyuan_v1_moe",),
        block_classes=("HunYuanMoEV1Moe",),
        router_classes=("HunYuanMoEV1Gate",),
        style=SoftmaxTopK(renormalise="always"),
        num_experts_key="num_experts",
        top_k_key="moe_topk",
        moe_layers=layers.every_layer,
        min_transformers=_TOPK_TUPLE,
    ),
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


def adapter_chosen(name: str) -> RoutingAdapter:
    """`--moe-family NAME`: one of a family's model types, or the family's name, in any case."""
    wanted = name.strip().lower()
    for adapter in ADAPTERS:
        if wanted in adapter.model_types or wanted == adapter.family.lower():
            return adapter
    known = ", ".join(t for adapter in ADAPTERS for t in adapter.model_types)
    raise ProbeError(f"--moe-family: '{name}' is not a known MoE family; known: {known}")
