"""Softmax routers: Qwen2/3-MoE, Qwen3-Next, Mixtral, OLMoE, Hunyuan-MoE, ERNIE-4.5-MoE.

The router returns `(logits, weights, experts)`; the weights are the float32 softmax over all
experts gathered at the chosen ones, renormalised per `renormalise`, cast to the output's dtype.
ERNIE selects on softmax + `e_score_correction_bias` but weights with the plain softmax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class SoftmaxTopK:
    weights_at: ClassVar[int] = 1  # (logits, weights, experts)
    renormalise: str = "flag"  # "flag": when router.norm_topk_prob; "always"; "clamped": / max(sum, norm_min)

    def chosen(self, router, output) -> torch.Tensor:
        return output[2]

    def selection_scores(self, router, output) -> torch.Tensor:
        probs = torch.softmax(output[0], dim=-1, dtype=torch.float)
        return router.moe_statics(probs) if self.renormalise == "clamped" else probs

    def router_logprobs(self, router, output) -> torch.Tensor:
        """`[tokens, experts]` float32 log of the softmax over all experts: RSPO's log r(e | c)."""
        return torch.log_softmax(output[0].float(), dim=-1)

    def replay(self, router, output, experts: torch.Tensor):
        logits, weights = output[0], output[1]
        gate = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if self.renormalise == "clamped":
            gate = gate / torch.clamp(gate.sum(dim=-1, keepdim=True), min=router.norm_min)
        elif self.renormalise == "always" or router.norm_topk_prob:
            gate /= gate.sum(dim=-1, keepdim=True)
        return logits, gate.to(weights.dtype), experts
