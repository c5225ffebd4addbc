"""A router's selection margin: how far its k-th chosen expert's score sits above the best unchosen one."""

from __future__ import annotations

import torch


def selection_margin(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[tokens]` float32: the k-th minus the (k+1)-th largest score; NaN where there is no finite (k+1)-th."""
    if scores.shape[-1] <= top_k:
        return torch.full(scores.shape[:1], float("nan"), device=scores.device)
    values = torch.topk(scores, top_k + 1, dim=-1).values
    margin = values[:, top_k - 1] - values[:, top_k]
    return torch.where(torch.isfinite(margin), margin, torch.full_like(margin, float("nan")))
