"""gpt-oss: top-k on the logits (with the router's bias), then softmax over just those k logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class SoftmaxOfTopK:
    weights_at: ClassVar[int] = 1  # (logits, weights, experts)

    def chosen(self, router, output) -> torch.Tensor:
        return output[2]

    def selection_scores(self, router, output) -> torch.Tensor:
        return output[0].float()

    def replay(self, router, output, experts: torch.Tensor):
        logits, weights = output[0], output[1]
        picked = logits.gather(1, experts)
        # In the weights' own dtype: the logits' unless the router ran in fp32 (router_dtype=fp32) with its weights
        # cast back, as the other styles keep them.
        return logits, torch.softmax(picked, dim=1, dtype=picked.dtype).to(weights.dtype), experts
