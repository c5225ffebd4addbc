"""The adapter interface, and the dense decoder the families share: GQA attention, SwiGLU MLP, RMSNorm.

An adapter turns an HF config.json into megatron-core TransformerConfig / GPTModel arguments and
maps each megatron parameter name (global expert ids, unsharded) to the tensor built from the HF
checkpoint, so weights are read lazily and a rank reads only what it holds.
"""

from __future__ import annotations

import re

import torch

from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint
from mismatch_probe.errors import ProbeError


def rope_parameters(hf: dict) -> dict:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def rope_type(hf: dict) -> str:
    rope = rope_parameters(hf)
    return rope.get("rope_type", rope.get("type", "default"))


def rope_theta(hf: dict) -> float:
    return float(rope_parameters(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def swiglu_fc1(ckpt: HFCheckpoint, prefix: str, gate: str = "gate_proj", up: str = "up_proj") -> torch.Tensor:
    """megatron's gated fc1 is [gate; up] stacked along the output dimension."""
    return torch.cat([ckpt.get(f"{prefix}{gate}.weight"), ckpt.get(f"{prefix}{up}.weight")])


def group_by_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """megatron stores QKV grouped by KV head: [q heads of group g; k_g; v_g] for each group g."""
    tail = q.shape[1:]
    parts = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


class DenseAdapter:
    """Qwen3-style decoder: GQA attention (optional q/k bias and per-head q/k RMSNorm), SwiGLU MLP."""

    architectures: tuple[str, ...] = ()
    multi_latent_attention = False
    rope_types = ("default",)

    def missing_feature(self, hf: dict) -> str | None:
        """What megatron-core cannot build for this config, or None."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            return f"hidden_act '{act}' (only 'silu')"
        kind = rope_type(hf)
        if kind not in self.rope_types:
            return f"rope_type '{kind}' (only {', '.join(repr(t) for t in self.rope_types)})"
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
            return "sliding-window attention layers"
        return None

    # ---- configuration -----------------------------------------------------------------------

    def qk_layernorm(self, hf: dict) -> bool:
        return False

    def qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("attention_bias", False))

    def rotary_percent(self, hf: dict) -> float:
        return float(rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))

    def config_kwargs(self, hf: dict) -> dict:
        heads = hf["num_attention_heads"]
        return dict(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            qk_layernorm=self.qk_layernorm(hf),
            add_qkv_bias=self.qkv_bias(hf),
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        )

    def config_attributes(self, hf: dict) -> dict:
        """Attributes to set on the built TransformerConfig (beyond its declared fields)."""
        return {}

    def model_kwargs(self, hf: dict) -> dict:
        """GPTModel arguments: rotary embedding and tied embeddings."""
        return dict(
            max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
            position_embedding_type="rope",
            rotary_base=rope_theta(hf),
            rotary_percent=self.rotary_percent(hf),
            share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        )

    # ---- weights -----------------------------------------------------------------------------

    def from_hf(self, name: str, ckpt: HFCheckpoint, hf: dict) -> torch.Tensor:
        """The full (unsharded) tensor for megatron parameter or buffer `name`."""
        top = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
            "output_layer.weight": "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else "lm_head.weight",
        }
        if name in top:
            return ckpt.get(top[name])
        tensor = None
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if match:
            prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
            tensor = self.attention_weight(rest, ckpt, prefix + "self_attn.", hf)
            if tensor is None:
                tensor = self.layer_weight(rest, ckpt, prefix, hf)
        if tensor is None:
            raise ProbeError(f"megatron parameter '{name}': no HF weight maps to it")
        return tensor

    def attention_weight(self, rest: str, ckpt: HFCheckpoint, attn: str, hf: dict) -> torch.Tensor | None:
        simple = {
            "self_attention.linear_proj.weight": "o_proj.weight",
            "self_attention.q_layernorm.weight": "q_norm.weight",
            "self_attention.k_layernorm.weight": "k_norm.weight",
        }
        if rest in simple:
            return ckpt.get(attn + simple[rest])
        groups = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        for kind in ("weight", "bias"):
            if rest == f"self_attention.linear_qkv.{kind}":
                q, k, v = (ckpt.get(f"{attn}{x}_proj.{kind}") for x in "qkv")
                return group_by_kv_head(q, k, v, groups)
        return None

    def layer_weight(self, rest: str, ckpt: HFCheckpoint, prefix: str, hf: dict) -> torch.Tensor | None:
        norms = {
            "input_layernorm.weight": "input_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        }
        if rest in norms:
            return ckpt.get(prefix + norms[rest])
        return self.mlp_weight(rest, ckpt, prefix, hf)

    def mlp_weight(self, rest: str, ckpt: HFCheckpoint, prefix: str, hf: dict) -> torch.Tensor | None:
        if rest == "mlp.linear_fc1.weight":
            return swiglu_fc1(ckpt, prefix + "mlp.")
        if rest == "mlp.linear_fc2.weight":
            return ckpt.get(prefix + "mlp.down_proj.weight")
        return None

    # ---- MoE shape (dense: none) -------------------------------------------------------------

    def moe_layers(self, hf: dict) -> list[bool]:
        return [False] * hf["num_hidden_layers"]

    def num_experts(self, hf: dict) -> int:
        return 0


class Qwen3Adapter(DenseAdapter):
    """Dense Qwen3: per-head q/k RMSNorm."""

    architectures = ("Qwen3ForCausalLM",)

    def missing_feature(self, hf: dict) -> str | None:
        if hf.get("attention_bias"):
            return "attention_bias on o_proj (megatron-core biases all linears or only QKV)"
        return super().missing_feature(hf)

    def qk_layernorm(self, hf: dict) -> bool:
        return True
