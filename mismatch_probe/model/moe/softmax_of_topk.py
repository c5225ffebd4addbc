"""gpt-oss: top-k on the logits (with the router's bias), then softmax over just those k logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SoftmaxOfTopK:
    def chosen(self, router, output) -> torch.Tensor:
        return output[2]

    def selection_scores(self, router, output) -> torch.Tensor:
        return output[0].float()

    def replay(self, router, output, experts: torch.Tensor):
        logits = output[0]
        picked = logits.gather(1, experts)
        return logits, torch.softmax(picked, dim=1, dtype=picked.dtype), experts
