"""DeepSeek-V3-style MoE (also GLM-4.5): sigmoid router with selection bias, group-limited top-k,
renormalised and scaled weights, shared experts, and `first_k_dense_replace` leading dense layers.

HF selects with `sigmoid(logits) + e_score_correction_bias` and weights with the plain sigmoid
scores of the chosen experts; megatron-core's sigmoid score function with `expert_bias` does the same.
"""

from __future__ import annotations

from mismatch_probe.engines.megatron.adapters.moe import MoeAdapter


class SigmoidRoutedAdapter(MoeAdapter):
    shared_expert = "shared_experts"

    def missing_feature(self, hf: dict) -> str | None:
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if top_k > 1 and not hf.get("norm_topk_prob", True):
            return "unnormalised sigmoid top-k weights (norm_topk_prob false; megatron-core always renormalises)"
        if top_k == 1 and hf.get("norm_topk_prob", True):
            return "renormalised top-1 sigmoid routing (megatron-core does not renormalise a single expert)"
        groups, chosen = self.groups(hf)
        if chosen and top_k // chosen != 2:
            return (
                f"group-limited routing with num_experts_per_tok // topk_group = {top_k // chosen} (HF scores "
                "a group by its top 2 experts, megatron-core by its top num_experts_per_tok // topk_group)"
            )
        return super().missing_feature(hf)

    def groups(self, hf: dict) -> tuple[int | None, int | None]:
        """(moe_router_num_groups, moe_router_group_topk), or (None, None) when no group is ever excluded."""
        groups, chosen = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if groups <= 1 or chosen >= groups:
            return None, None
        return groups, chosen

    def moe_layers(self, hf: dict) -> list[bool]:
        first_moe = int(hf.get("first_k_dense_replace") or 0)
        return [bool(self.num_experts(hf)) and i >= first_moe for i in range(hf["num_hidden_layers"])]

    def routing_kwargs(self, hf: dict) -> dict:
        groups, chosen = self.groups(hf)
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            moe_router_num_groups=groups,
            moe_router_group_topk=chosen,
            moe_router_dtype="fp32",  # HF routes in float32 whatever the model dtype
            moe_router_pre_softmax=False,
        )

    def shared_expert_kwargs(self, hf: dict) -> dict:
        shared = int(hf.get("n_shared_experts") or 0)
        if not shared:
            return {}
        return dict(moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"])
