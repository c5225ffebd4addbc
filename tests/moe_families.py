"""Tiny random-init checkpoints of every MoE family, and a naive second implementation of each router's
expert choice (from the logits the router returned), for the family tests."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=96,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,  # no zeroed pad embedding: no tied router logits
    tie_word_embeddings=False,
    initializer_range=0.2,
)


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[], object]  # a transformers config
    moe_layers: tuple[int, ...]  # computed by hand from the config below
    router_class: str
    select: str  # naive selection rule: "topk_logits", "biased_softmax", "grouped_sigmoid", "llama4"
    model_type: str | None = None  # rewrite config.json's model_type (Kimi-K2)


def _cfg(name: str, **kwargs):
    import transformers

    return getattr(transformers, name)(**{**COMMON, **kwargs})


_SIGMOID = dict(moe_intermediate_size=32, n_shared_experts=1, num_experts_per_tok=2, n_routed_experts=8)
_MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=16,
    num_key_value_heads=2,
)

FAMILIES = [
    Family(
        "qwen3_moe",
        lambda: _cfg(
            "Qwen3MoeConfig",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        (0, 2, 3),
        "Qwen3MoeTopKRouter",
        "topk_logits",
    ),
    Family(
        "qwen2_moe",
        lambda: _cfg(
            "Qwen2MoeConfig",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
        (1, 3),
        "Qwen2MoeTopKRouter",
        "topk_logits",
    ),
    Family(
        "qwen3_next",
        lambda: _cfg(
            "Qwen3NextConfig",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
        ),
        (1, 2, 3),
        "Qwen3NextTopKRouter",
        "topk_logits",
    ),
    Family(
        "mixtral",
        lambda: _cfg("MixtralConfig", num_local_experts=8, num_experts_per_tok=2),
        (0, 1, 2, 3),
        "MixtralTopKRouter",
        "topk_logits",
    ),
    Family(
        "olmoe",
        lambda: _cfg("OlmoeConfig", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        (0, 1, 2, 3),
        "OlmoeTopKRouter",
        "topk_logits",
    ),
    Family(
        "deepseek_v3",
        lambda: _cfg(
            "DeepseekV3Config",
            **_SIGMOID,
            **_MLA,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        (1, 2, 3),
        "DeepseekV3TopkRouter",
        "grouped_sigmoid",
    ),
    Family(
        "kimi_k2",
        lambda: _cfg(
            "DeepseekV3Config",
            **_SIGMOID,
            **_MLA,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            routed_scaling_factor=2.827,
            norm_topk_prob=True,
        ),
        (2, 3),
        "DeepseekV3TopkRouter",
        "grouped_sigmoid",
        model_type="kimi_k2",
    ),
    Family(
        "glm4_moe",
        lambda: _cfg(
            "Glm4MoeConfig",
            **_SIGMOID,
            n_group=2,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
        ),
        (1, 2, 3),
        "Glm4MoeTopkRouter",
        "grouped_sigmoid",
    ),
    Family(
        "dots1",
        lambda: _cfg(
            "Dots1Config",
            **_SIGMOID,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
        ),
        (2, 3),
        "Dots1TopkRouter",
        "grouped_sigmoid",
    ),
    Family(
        "gpt_oss",
        lambda: _cfg("GptOssConfig", num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
        (0, 1, 2, 3),
        "GptOssTopKRouter",
        "topk_logits",
    ),
    Family(
        "llama4_text",
        lambda: _cfg(
            "Llama4TextConfig",
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            intermediate_size=32,
            intermediate_size_mlp=96,
        ),
        (1, 3),
        "Llama4Router",
        "llama4",
    ),
    Family(
        "ernie4_5_moe",
        lambda: _cfg(
            "Ernie4_5_MoeConfig",
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
        ),
        (1, 2, 3),
        "Ernie4_5_MoeTopKRouter",
        "biased_softmax",
    ),
    Family(
        "hunyuan_v1_moe",
        lambda: _cfg("HunYuanMoEV1Config", num_experts=8, moe_topk=2),
        (0, 1, 2, 3),
        "HunYuanMoEV1Gate",
        "topk_logits",
    ),
]


def expert_sets(frame, layers: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A token table's `experts` as sorted `[tokens, layers, k]` ids (zeros where null), and where they are set."""
    valid = frame["experts"].is_not_null().to_numpy()
    ids = np.zeros((len(frame), layers, k), np.int64)
    ids[valid] = np.stack(frame["experts"].filter(frame["experts"].is_not_null()).to_list()).reshape(-1, layers, k)
    return np.sort(ids, axis=-1), valid


def selection_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """ERNIE, DeepSeek-style: a bias added for selection only; gpt-oss: the router's logit bias."""
    if hasattr(module, "moe_statics"):
        return module.moe_statics.e_score_correction_bias
    if hasattr(module, "e_score_correction_bias"):
        return module.e_score_correction_bias
    return module.bias if type(module).__name__ == "GptOssTopKRouter" else None


def save_family(family: Family, path: Path, seed: int = 0) -> Path:
    """Random init with a fixed seed; selection biases (where the family has one) set to non-zero values
    large enough to change choices."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family.config(), dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__ == family.router_class and selection_bias(module) is not None:
            bias = selection_bias(module)
            with torch.no_grad():
                bias.copy_(torch.linspace(-0.2, 0.2, bias.numel()).view_as(bias)[..., torch.randperm(bias.shape[-1])])
    model.save_pretrained(path)
    if family.model_type:
        config = json.loads((path / "config.json").read_text())
        config["model_type"] = family.model_type
        (path / "config.json").write_text(json.dumps(config))
    return path


def naive_choice(family: Family, module: torch.nn.Module, output) -> list[set[int]]:
    """The expert set of each token, recomputed from the router's logits with a plain loop."""
    logits = (output[1] if family.select == "llama4" else output[0]).detach().double().numpy()
    k = module.top_k
    if family.select in ("topk_logits", "llama4"):  # softmax is monotone: top-k of probs is top-k of logits
        return [set(np.argsort(-row)[:k].tolist()) for row in logits]
    bias = selection_bias(module).detach().double().numpy().reshape(-1)
    if family.select == "biased_softmax":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return [set(np.argsort(-(row + bias))[:k].tolist()) for row in probs]
    return [_grouped(1 / (1 + np.exp(-row)) + bias, module.num_group, module.topk_group, k) for row in logits]


def _grouped(scores: np.ndarray, groups: int, keep_groups: int, k: int) -> set[int]:
    return set(np.argsort(-_group_masked(scores, groups, keep_groups))[:k].tolist())


def naive_margin(family: Family, module: torch.nn.Module, output) -> list[float]:
    """Each token's k-th minus (k+1)-th largest selection score, recomputed from the router's logits with a
    plain loop (NaN where group limiting leaves no (k+1)-th candidate)."""
    logits = (output[1] if family.select == "llama4" else output[0]).detach().double().numpy()
    k = module.top_k
    if family.select in ("topk_logits", "biased_softmax") and family.name != "gpt_oss":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        scores = probs / probs.sum(-1, keepdims=True)
        if family.select == "biased_softmax":
            scores = scores + selection_bias(module).detach().double().numpy().reshape(-1)
    elif family.select == "grouped_sigmoid":
        scores = 1 / (1 + np.exp(-logits)) + selection_bias(module).detach().double().numpy().reshape(-1)
        scores = np.array([_group_masked(row, module.num_group, module.topk_group) for row in scores])
    else:  # gpt-oss and Llama-4 rank experts by their logits
        scores = logits
    margins = []
    for row in scores:
        ranked = sorted(row.tolist(), reverse=True)
        margin = ranked[k - 1] - ranked[k]
        margins.append(margin if math.isfinite(margin) else math.nan)
    return margins


def _group_masked(scores: np.ndarray, groups: int, keep_groups: int) -> np.ndarray:
    per_group = scores.reshape(groups, -1)
    group_score = np.sort(per_group, axis=1)[:, -2:].sum(1)
    allowed = np.zeros_like(per_group, dtype=bool)
    allowed[np.argsort(-group_score)[:keep_groups]] = True
    return np.where(allowed.reshape(-1), scores, -np.inf)
