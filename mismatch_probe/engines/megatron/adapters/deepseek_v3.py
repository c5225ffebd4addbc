"""DeepSeek-V3 / R1 and Kimi-K2 (DeepseekV3ForCausalLM): multi-latent attention (MLA) with
megatron-core's MLATransformerConfig, and the sigmoid-routed MoE of sigmoid_routing.py."""

from __future__ import annotations

import torch

from mismatch_probe.engines.megatron.adapters.base import rope_parameters, rope_theta, rope_type
from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint
from mismatch_probe.engines.megatron.adapters.sigmoid_routing import SigmoidRoutedAdapter

MLA_WEIGHTS = {
    "linear_q_proj.weight": "q_proj.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}


def interleave_rope_rows(weight: torch.Tensor, heads: int, start: int, rope: int) -> torch.Tensor:
    """megatron's MLA de-interleaves the rotary dims (x[0::2], x[1::2]) before rotating halves;
    HF without `rope_interleave` rotates halves directly. Interleave the rotary rows so both agree."""
    rows = weight.view(heads, -1, weight.shape[-1])
    rotary = rows[:, start : start + rope].reshape(heads, 2, rope // 2, -1).transpose(1, 2).reshape(heads, rope, -1)
    return torch.cat([rows[:, :start], rotary, rows[:, start + rope :]], dim=1).reshape(weight.shape)


class DeepseekV3Adapter(SigmoidRoutedAdapter):
    architectures = ("DeepseekV3ForCausalLM",)
    multi_latent_attention = True
    rope_types = ("default", "yarn")

    def missing_feature(self, hf: dict) -> str | None:
        if hf.get("attention_bias"):
            return "attention_bias (megatron-core's MLA projections have no bias)"
        return super().missing_feature(hf)

    def config_kwargs(self, hf: dict) -> dict:
        kwargs = super().config_kwargs(hf)
        kwargs.update(
            multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            # The local core attention sizes its output by kv_channels: the value head width.
            kv_channels=hf["v_head_dim"],
            num_query_groups=hf["num_attention_heads"],
            qk_layernorm=True,  # builds q_a_layernorm / kv_a_layernorm
            add_qkv_bias=False,
            rotary_base=rope_theta(hf),
            **self.rope_kwargs(hf),
        )
        return kwargs

    def rope_kwargs(self, hf: dict) -> dict:
        if rope_type(hf) != "yarn":
            return dict(rope_type="rope", rotary_scaling_factor=1.0)  # softmax scale 1/sqrt(q head dim)
        rope = rope_parameters(hf)
        return dict(
            rope_type="yarn",
            rotary_scaling_factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 1.0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )

    def attention_weight(self, rest: str, ckpt: HFCheckpoint, attn: str, hf: dict) -> torch.Tensor | None:
        name = rest.removeprefix("self_attention.")
        if name == rest or name not in MLA_WEIGHTS:
            return None
        weight = ckpt.get(attn + MLA_WEIGHTS[name])
        if hf.get("rope_interleave", True):
            return weight
        nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        if name in ("linear_q_proj.weight", "linear_q_up_proj.weight"):
            return interleave_rope_rows(weight, hf["num_attention_heads"], nope, rope)
        if name == "linear_kv_down_proj.weight":
            return interleave_rope_rows(weight, 1, hf["kv_lora_rank"], rope)
        return weight
