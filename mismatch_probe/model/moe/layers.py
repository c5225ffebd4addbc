"""Which decoder layers are MoE: one rule per family, mirroring each modeling file's own test."""

from __future__ import annotations

from typing import Any


def every_layer(config: Any, n_layers: int) -> tuple[int, ...]:
    """Mixtral, OLMoE, gpt-oss, Hunyuan-MoE: every decoder layer has a router."""
    return tuple(range(n_layers))


def sparse_step(config: Any, n_layers: int) -> tuple[int, ...]:
    """Qwen2-MoE, Qwen3-MoE, Qwen3-Next: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def after_first_k_dense(config: Any, n_layers: int) -> tuple[int, ...]:
    """DeepSeek-V3, Kimi-K2, GLM-4.5, dots1: the first `first_k_dense_replace` layers are dense."""
    first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return tuple(range(first, n_layers))


def start_end_interval(config: Any, n_layers: int) -> tuple[int, ...]:
    """ERNIE-4.5-MoE: every `moe_layer_interval`-th layer from `moe_layer_start_index` to `moe_layer_end_index`
    (inclusive; -1 means the last layer)."""
    start = int(getattr(config, "moe_layer_start_index", 0) or 0)
    end = int(getattr(config, "moe_layer_end_index", -1))
    end = n_layers - 1 if end == -1 else end
    interval = int(getattr(config, "moe_layer_interval", 1) or 1)
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end)


def interleaved(config: Any, n_layers: int) -> tuple[int, ...]:
    """Llama-4: `moe_layers` when given, else every `interleave_moe_layer_step`-th layer."""
    listed = getattr(config, "moe_layers", None)
    if listed is not None:
        return tuple(sorted(int(i) for i in listed if int(i) < n_layers))
    step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
    return tuple(range(step - 1, n_layers, step))
