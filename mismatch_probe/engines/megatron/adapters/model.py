"""Build the megatron-core GPTModel of an HF checkpoint, weights loaded, in the engine's dtype."""

from __future__ import annotations

import torch

from mismatch_probe.engines.megatron.adapters import adapter_for, read_hf_config
from mismatch_probe.engines.megatron.adapters.config import transformer_config
from mismatch_probe.engines.megatron.adapters.loading import cast_to_compute_dtype, load_hf_weights
from mismatch_probe.engines.megatron.shims import attention_backend_env, cpu_device_scope, local_mla_core_attention
from mismatch_probe.model.routing_shape import ModelInfo


def build_gpt_model(
    model: ModelInfo,
    dtype: str,
    tensor_parallel: int,
    expert_parallel: int,
    device: torch.device,
    use_transformer_engine: bool,
    overrides: dict | None = None,
) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    adapter, hf = adapter_for(model), read_hf_config(model)
    cfg = transformer_config(
        model, dtype, tensor_parallel, expert_parallel, device.type == "cuda", use_transformer_engine, overrides
    )
    with cpu_device_scope(), attention_backend_env():
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=use_transformer_engine, normalization="RMSNorm")
        if not use_transformer_engine:
            local_mla_core_attention(spec)
        module = GPTModel(cfg, spec, vocab_size=model.vocab_size, **adapter.model_kwargs(hf))
    load_hf_weights(module, model, dtype)
    return cast_to_compute_dtype(module, dtype).to(device).eval()
