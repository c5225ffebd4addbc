"""Copy an HF checkpoint into a built megatron GPTModel, tensor by tensor, sharded for this rank."""

from __future__ import annotations

import re

import torch

from mismatch_probe.engines.megatron.adapters import adapter_for, read_hf_config
from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.vocab import COMPUTE_TORCH, FP32_BF16W, HALF, WEIGHT_TORCH

# The TransformerEngine layer spec fuses the norm before a linear into that linear.
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _shard(full: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's slice of an unsharded megatron tensor (TP / expert-TP partitions)."""
    if full.shape == param.shape:
        return full
    from megatron.core import parallel_state as ps

    differing = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
    if len(differing) != 1 or full.shape[differing[0]] % param.shape[differing[0]]:
        raise ProbeError(f"megatron parameter '{name}': cannot shard {tuple(full.shape)} into {tuple(param.shape)}")
    dim = differing[0]
    parts = full.shape[dim] // param.shape[dim]
    rank = ps.get_expert_tensor_parallel_rank() if ".experts." in name else ps.get_tensor_model_parallel_rank()
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        # Each rank holds [gate shard; up shard], not a contiguous slice of [gate; up].
        full = full.view(2, parts, -1, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    return full.chunk(parts, dim=dim)[rank]


def _global_name(name: str, first_expert: int) -> str:
    name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{first_expert + int(m.group(1))}.", name)
    for fused, plain in TE_FUSED_NORMS.items():
        name = name.replace(fused, plain)
    return name


def load_hf_weights(module: torch.nn.Module, model: ModelInfo, dtype: str) -> None:
    """Every parameter, and the routers' expert_bias buffers (HF's e_score_correction_bias)."""
    from megatron.core import parallel_state as ps

    adapter, hf, ckpt = adapter_for(model), read_hf_config(model), HFCheckpoint(model.path)
    first_expert = 0
    if any(adapter.moe_layers(hf)):
        per_rank = adapter.num_experts(hf) // ps.get_expert_model_parallel_world_size()
        first_expert = ps.get_expert_model_parallel_rank() * per_rank
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("router.expert_bias")]
    for name, target in list(module.named_parameters()) + biases:
        tensor = _shard(adapter.from_hf(_global_name(name, first_expert), ckpt, hf), target, name)
        if tensor.shape != target.shape:
            raise ProbeError(
                f"{model.path}: weight for '{name}' has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        if dtype == FP32_BF16W and not name.endswith("expert_bias"):
            tensor = tensor.to(getattr(torch, WEIGHT_TORCH[dtype]))
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))


def cast_to_compute_dtype(module: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """What megatron's Float16Module does for bf16 / fp16 training: every parameter (norms included;
    the local spec builds those in fp32) in the half type. The expert biases stay float32, as
    megatron-core keeps them (and HF keeps e_score_correction_bias) in float32."""
    if dtype not in HALF:
        return module
    half = getattr(torch, COMPUTE_TORCH[dtype])
    biases = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("router.expert_bias")}
    module = module.to(half)
    for name, buffer in module.named_buffers():
        if name in biases:
            buffer.data = biases[name]
    return module
