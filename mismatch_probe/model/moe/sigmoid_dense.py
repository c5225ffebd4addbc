"""Llama-4: the router returns `(scores, logits)`; scores are dense `[tokens, experts]`, the
sigmoid of the top-k logits and 0 (sigmoid of -inf) elsewhere. The chosen experts are the top-k
of the logits, which is the router's own `topk` call repeated on the same tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class SigmoidDenseScores:
    weights_at: ClassVar[int] = 0  # (scores, logits): the dense scores weight the experts

    def chosen(self, router, output) -> torch.Tensor:
        return torch.topk(output[1], router.top_k, dim=1).indices

    def selection_scores(self, router, output) -> torch.Tensor:
        return output[1].float()

    def replay(self, router, output, experts: torch.Tensor):
        scores, logits = output
        picked = torch.full_like(logits, float("-inf")).scatter_(1, experts, logits.gather(1, experts))
        return torch.sigmoid(picked.float()).to(scores.dtype), logits
