"""HF checkpoint -> megatron-core GPTModel: the TransformerConfig and the weights, one adapter per architecture.

An adapter maps a megatron parameter name (global expert ids, unsharded) to the tensor built from
the HF checkpoint, so weights are read lazily, tensor by tensor, and a rank reads only what it holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ProbeError
from ..modelinfo import ModelInfo

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp32-bf16w": torch.float32}


class HFCheckpoint:
    """Lazy reader of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise ProbeError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, "pt") as handle:
                self.files = {name: single for name in handle.keys()}
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ProbeError(f"{self.path}: missing weight '{name}'")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(name)


def rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ProbeError(f"config.json: rope_type '{kind}' is not supported by the megatron engine (only 'default')")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


class Qwen3Adapter:
    """Dense Qwen3: per-head q/k RMSNorm, GQA, SwiGLU MLP."""

    architectures = ("Qwen3ForCausalLM",)
    qk_layernorm = True

    def config_kwargs(self, hf: dict, model: ModelInfo) -> dict:
        heads = hf["num_attention_heads"]
        return dict(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads", heads),
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            qk_layernorm=self.qk_layernorm,
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        )

    def hf_layer_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}."

    def from_hf(self, name: str, ckpt: HFCheckpoint, hf: dict) -> torch.Tensor:
        """The full (unsharded) tensor for megatron parameter `name`."""
        top = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
            "output_layer.weight": "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else "lm_head.weight",
        }
        if name in top:
            return ckpt.get(top[name])
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if not match:
            raise ProbeError(f"megatron parameter '{name}': no HF weight maps to it")
        layer, rest = int(match.group(1)), match.group(2)
        hf_prefix = self.hf_layer_prefix(layer)
        attn = hf_prefix + "self_attn."
        simple = {
            "input_layernorm.weight": hf_prefix + "input_layernorm.weight",
            "pre_mlp_layernorm.weight": hf_prefix + "post_attention_layernorm.weight",
            "self_attention.linear_proj.weight": attn + "o_proj.weight",
            "self_attention.q_layernorm.weight": attn + "q_norm.weight",
            "self_attention.k_layernorm.weight": attn + "k_norm.weight",
        }
        if rest in simple:
            return ckpt.get(simple[rest])
        if rest == "self_attention.linear_qkv.weight":
            return self._qkv(ckpt, attn, hf)
        return self.mlp_from_hf(rest, ckpt, hf_prefix, name)

    def _qkv(self, ckpt: HFCheckpoint, attn: str, hf: dict) -> torch.Tensor:
        # megatron stores QKV grouped by KV head: [q heads of group g; k_g; v_g] for each group g.
        q, k, v = (ckpt.get(attn + f"{x}_proj.weight") for x in "qkv")
        groups = hf.get("num_key_value_heads", hf["num_attention_heads"])
        hidden = q.shape[1]
        return torch.cat(
            [q.view(groups, -1, hidden), k.view(groups, -1, hidden), v.view(groups, -1, hidden)], dim=1
        ).reshape(-1, hidden)

    def mlp_from_hf(self, rest: str, ckpt: HFCheckpoint, hf_prefix: str, name: str) -> torch.Tensor:
        mlp = hf_prefix + "mlp."
        if rest == "mlp.linear_fc1.weight":
            return torch.cat([ckpt.get(mlp + "gate_proj.weight"), ckpt.get(mlp + "up_proj.weight")])
        if rest == "mlp.linear_fc2.weight":
            return ckpt.get(mlp + "down_proj.weight")
        raise ProbeError(f"megatron parameter '{name}': no HF weight maps to it")


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE: Qwen3 attention; MoE layers with a linear router and SwiGLU experts, no shared expert."""

    architectures = ("Qwen3MoeForCausalLM",)
    expert_weights = ("gate_proj", "up_proj", "down_proj")  # gate, up, down

    def config_kwargs(self, hf: dict, model: ModelInfo) -> dict:
        kwargs = super().config_kwargs(hf, model)
        if model.moe_layer_indices:
            kwargs.update(
                num_moe_experts=model.num_experts,
                moe_router_topk=model.top_k,
                moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                moe_layer_freq=[int(i in model.moe_layer_indices) for i in range(model.num_hidden_layers)],
                # pre_softmax=False: softmax over the top-k logits, i.e. renormalised top-k weights
                # (norm_topk_prob); True: softmax over all experts, top-k not renormalised.
                moe_router_pre_softmax=not self.normalises_top_k(hf),
            )
        return kwargs

    def normalises_top_k(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", False))

    def moe_prefix(self, ckpt: HFCheckpoint, hf_prefix: str) -> str:
        return hf_prefix + "mlp."

    def mlp_from_hf(self, rest: str, ckpt: HFCheckpoint, hf_prefix: str, name: str) -> torch.Tensor:
        moe = self.moe_prefix(ckpt, hf_prefix)
        if rest == "mlp.router.weight":
            return ckpt.get(moe + "gate.weight")
        match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight", rest)
        if not match:
            return super().mlp_from_hf(rest, ckpt, hf_prefix, name)
        gate, up, down = (f"{moe}experts.{match.group(1)}.{w}.weight" for w in self.expert_weights)
        if match.group(2) == "linear_fc2":
            return ckpt.get(down)
        return torch.cat([ckpt.get(gate), ckpt.get(up)])


class MixtralAdapter(Qwen3MoeAdapter):
    """Mixtral: no q/k norm; softmax -> top-k -> renormalise (always)."""

    architectures = ("MixtralForCausalLM",)
    qk_layernorm = False
    expert_weights = ("w1", "w3", "w2")

    def normalises_top_k(self, hf: dict) -> bool:
        return True

    def moe_prefix(self, ckpt: HFCheckpoint, hf_prefix: str) -> str:
        # Original Mixtral checkpoints name the MoE block `block_sparse_moe`; later saves use `mlp`.
        legacy = hf_prefix + "block_sparse_moe."
        return legacy if legacy + "gate.weight" in ckpt else hf_prefix + "mlp."


ADAPTERS = {arch: cls for cls in (Qwen3Adapter, Qwen3MoeAdapter, MixtralAdapter) for arch in cls.architectures}


def adapter_for(model: ModelInfo) -> Qwen3Adapter:
    if model.architecture not in ADAPTERS:
        raise ProbeError(
            f"{model.path / 'config.json'}: architecture '{model.architecture}' is not supported by the megatron "
            f"engine (supported: {', '.join(sorted(ADAPTERS))})"
        )
    return ADAPTERS[model.architecture]()


def read_hf_config(model: ModelInfo) -> dict:
    return json.loads((model.path / "config.json").read_text())


def transformer_config(model: ModelInfo, dtype: str, tensor_parallel: int, expert_parallel: int, on_gpu: bool):
    """megatron TransformerConfig for an inference-only forward of the HF model."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = read_hf_config(model)
    kwargs = adapter_for(model).config_kwargs(hf, model)
    if model.moe_layer_indices:
        kwargs.update(
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_enable_routing_replay=True,
            expert_model_parallel_size=expert_parallel,
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ProbeError(f"config.json: hidden_act '{act}' is not supported by the megatron engine (only 'silu')")
    return TransformerConfig(
        **kwargs,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=TORCH_DTYPES[dtype],
        bf16=dtype == "bf16",
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
    )


# The TransformerEngine layer spec fuses the pre-attention / pre-MLP norms into the next linear.
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _shard(full: torch.Tensor, param: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
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
    if gated and name.endswith("linear_fc1.weight"):
        # Each rank holds [gate shard; up shard], not a contiguous slice of [gate; up].
        full = full.view(2, parts, -1, full.shape[-1]).transpose(0, 1).reshape(full.shape)
    return full.chunk(parts, dim=dim)[rank]


def load_hf_weights(module: torch.nn.Module, model: ModelInfo, dtype: str) -> None:
    """Copy the HF checkpoint into a megatron GPTModel, reading each tensor only when needed."""
    from megatron.core import parallel_state as ps

    adapter, hf, ckpt = adapter_for(model), read_hf_config(model), HFCheckpoint(model.path)
    first_expert = 0
    if model.moe_layer_indices:
        first_expert = ps.get_expert_model_parallel_rank() * (model.num_experts // ps.get_expert_model_parallel_world_size())
    for name, param in module.named_parameters():
        global_name = re.sub(
            r"local_experts\.(\d+)\.", lambda m: f"local_experts.{first_expert + int(m.group(1))}.", name
        )
        for fused, plain in TE_FUSED_NORMS.items():
            global_name = global_name.replace(fused, plain)
        tensor = _shard(adapter.from_hf(global_name, ckpt, hf), param, name, gated=True)
        if tensor.shape != param.shape:
            raise ProbeError(
                f"{model.path}: weight for '{name}' has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        if dtype == "fp32-bf16w":
            tensor = tensor.to(torch.bfloat16)
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
