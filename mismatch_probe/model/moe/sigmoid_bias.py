"""Sigmoid routers with a selection bias: DeepSeek-V3, Kimi-K2, GLM-4.5, dots1.

They select on `sigmoid(logits) + e_score_correction_bias` (group-limited top-k) but weight with
the plain sigmoid scores of the chosen experts, renormalised when `norm_topk_prob` (with the
model's 1e-20 guard), times `routed_scaling_factor`. The logits are float32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

NORM_GUARD = 1e-20  # what the modeling code adds to the denominator


@dataclass(frozen=True)
class SigmoidWithBias:
    weights_at: ClassVar[int] = 1  # (logits, weights, experts)

    def chosen(self, router, output) -> torch.Tensor:
        return output[2]

    def selection_scores(self, router, output) -> torch.Tensor:
        """sigmoid + bias, -inf outside the groups the router keeps (its group-limited top-k)."""
        scores = output[0].float().sigmoid() + router.e_score_correction_bias.float()
        return group_limited_scores(scores, router.num_group, router.topk_group, 2)

    def replay(self, router, output, experts: torch.Tensor):
        logits, weights = output[0], output[1]
        gate = logits.sigmoid().gather(1, experts)
        if router.norm_topk_prob:
            gate /= gate.sum(dim=-1, keepdim=True) + NORM_GUARD
        gate = gate * router.routed_scaling_factor
        return logits, gate.to(weights.dtype), experts


def group_limited_scores(scores: torch.Tensor, groups: int, kept: int, per_group_top: int) -> torch.Tensor:
    """`scores` with -inf outside the `kept` groups of highest sum of their `per_group_top` best scores."""
    size = scores.shape[-1] // groups
    group_scores = scores.view(-1, groups, size).topk(min(per_group_top, size), dim=-1)[0].sum(dim=-1)
    mask = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(kept, dim=-1)[1], 1.0)
    mask = mask.bool()[:, :, None].expand(-1, groups, size).reshape(scores.shape)
    return scores.masked_fill(~mask, float("-inf"))
