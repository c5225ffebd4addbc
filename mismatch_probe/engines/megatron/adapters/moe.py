"""MoE layers: router, routed SwiGLU experts, optional shared expert; softmax routing by default."""

from __future__ import annotations

import re

import torch

from mismatch_probe.engines.megatron.adapters.base import DenseAdapter, swiglu_fc1
from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint


class MoeAdapter(DenseAdapter):
    """A linear router over `num_experts` SwiGLU experts at `mlp.experts.E`, router at `mlp.gate`."""

    expert_weights = ("gate_proj", "up_proj", "down_proj")
    shared_expert = ""  # HF name of the shared expert MLP under `mlp.`, if the family has one

    def num_experts(self, hf: dict) -> int:
        # transformers saves the same count under different keys across families and versions.
        return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)

    def moe_layers(self, hf: dict) -> list[bool]:
        """Qwen2/Qwen3 rule: every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
        if not self.num_experts(hf):
            return super().moe_layers(hf)
        dense_only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        return [i not in dense_only and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]

    def normalises_top_k(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", False))

    def routing_kwargs(self, hf: dict) -> dict:
        # pre_softmax=False: softmax over the top-k logits, i.e. renormalised top-k weights;
        # True: softmax over all experts, top-k weights not renormalised.
        return dict(moe_router_pre_softmax=not self.normalises_top_k(hf))

    def shared_expert_kwargs(self, hf: dict) -> dict:
        return {}

    def config_kwargs(self, hf: dict) -> dict:
        kwargs = super().config_kwargs(hf)
        layers = self.moe_layers(hf)
        if any(layers):
            kwargs.update(
                num_moe_experts=self.num_experts(hf),
                moe_router_topk=int(hf["num_experts_per_tok"]),
                moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                moe_layer_freq=[int(flag) for flag in layers],
                **self.routing_kwargs(hf),
                **self.shared_expert_kwargs(hf),
            )
        return kwargs

    def moe_prefix(self, ckpt: HFCheckpoint, layer_prefix: str) -> str:
        return layer_prefix + "mlp."

    def mlp_weight(self, rest: str, ckpt: HFCheckpoint, prefix: str, hf: dict) -> torch.Tensor | None:
        moe = self.moe_prefix(ckpt, prefix)
        routers = {
            "mlp.router.weight": "gate.weight",
            "mlp.router.expert_bias": "gate.e_score_correction_bias",
            "mlp.shared_experts.gate_weight": "shared_expert_gate.weight",
        }
        if rest in routers:
            return ckpt.get(moe + routers[rest])
        match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight", rest)
        if match:
            gate, up, down = self.expert_weights
            expert = f"{moe}experts.{match.group(1)}."
            if match.group(2) == "linear_fc2":
                return ckpt.get(f"{expert}{down}.weight")
            return swiglu_fc1(ckpt, expert, gate, up)
        match = re.fullmatch(r"mlp\.shared_experts\.(linear_fc1|linear_fc2)\.weight", rest)
        if match and self.shared_expert:
            shared = f"{moe}{self.shared_expert}."
            return swiglu_fc1(ckpt, shared) if match.group(1) == "linear_fc1" else ckpt.get(shared + "down_proj.weight")
        return super().mlp_weight(rest, ckpt, prefix, hf)
