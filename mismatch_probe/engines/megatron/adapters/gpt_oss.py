"""gpt-oss (GptOssForCausalLM): attention with biases and learned sinks (`softmax_type='learnable'`),
alternating sliding-window layers, YaRN RoPE; softmax over the top-k router logits (router bias);
experts with biases and gpt-oss's clamped SwiGLU (`quick_gelu`, `glu_linear_offset`,
`activation_func_clamp_value`), gate and up interleaved column by column in HF."""

from __future__ import annotations

import re

import torch

from mismatch_probe.engines.megatron.adapters.base import DenseAdapter, rope_parameters, rope_type
from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint

QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu constant


class GptOssAdapter(DenseAdapter):
    architectures = ("GptOssForCausalLM",)

    def missing_feature(self, hf: dict) -> str | None:
        if float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
            return f"swiglu_alpha {hf['swiglu_alpha']} (megatron-core's quick_gelu uses {QUICK_GELU_ALPHA})"
        if rope_type(hf) not in ("default", "yarn"):
            return f"rope_type '{rope_type(hf)}' (only 'default', 'yarn')"
        return None

    def num_experts(self, hf: dict) -> int:
        return int(hf["num_local_experts"])

    def moe_layers(self, hf: dict) -> list[bool]:
        return [True] * hf["num_hidden_layers"]

    def config_kwargs(self, hf: dict) -> dict:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        sliding = [kind == "sliding_attention" for kind in hf.get("layer_types") or []]
        return dict(
            super().config_kwargs(hf),
            add_bias_linear=True,
            softmax_type="learnable",
            # HF attends to the last `sliding_window` positions, the query's own included.
            window_size=(hf["sliding_window"] - 1, 0) if any(sliding) else None,
            window_attn_skip_freq=[int(flag) for flag in sliding] if any(sliding) else None,
            num_moe_experts=self.num_experts(hf),
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_pre_softmax=False,
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        )

    def config_attributes(self, hf: dict) -> dict:
        if rope_type(hf) != "yarn":
            return {}
        rope = rope_parameters(hf)
        return dict(
            yarn_rotary_scaling_factor=float(rope["factor"]),
            yarn_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
            yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
            yarn_mscale=rope.get("mscale"),
            yarn_mscale_all_dim=rope.get("mscale_all_dim"),
            yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
        )

    def model_kwargs(self, hf: dict) -> dict:
        return dict(super().model_kwargs(hf), position_embedding_type="yarn" if rope_type(hf) == "yarn" else "rope")

    def attention_weight(self, rest: str, ckpt: HFCheckpoint, attn: str, hf: dict) -> torch.Tensor | None:
        if rest == "self_attention.core_attention.softmax_offset":
            return ckpt.get(attn + "sinks")
        if rest == "self_attention.linear_proj.bias":
            return ckpt.get(attn + "o_proj.bias")
        return super().attention_weight(rest, ckpt, attn, hf)

    def mlp_weight(self, rest: str, ckpt: HFCheckpoint, prefix: str, hf: dict) -> torch.Tensor | None:
        moe = prefix + "mlp."
        if rest in ("mlp.router.weight", "mlp.router.bias"):
            return ckpt.get(moe + rest.removeprefix("mlp."))
        match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)", rest)
        if not match:
            return None
        expert, layer, kind = int(match.group(1)), match.group(2), match.group(3)
        if layer == "linear_fc2":
            tensor = ckpt.get(moe + ("experts.down_proj" if kind == "weight" else "experts.down_proj_bias"))[expert]
            return tensor.T.contiguous() if kind == "weight" else tensor
        tensor = ckpt.get(moe + ("experts.gate_up_proj" if kind == "weight" else "experts.gate_up_proj_bias"))[expert]
        # HF: [hidden, 2 * ffn] (bias [2 * ffn]) with gate in even and up in odd columns; megatron: [gate; up] rows.
        joined = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
        return joined.T.contiguous() if kind == "weight" else joined
