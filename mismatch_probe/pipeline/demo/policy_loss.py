"""The truncated-IS policy-gradient loss of a micro-batch, and the log-probs of stored tokens it rests on."""

from __future__ import annotations

import numpy as np
import torch

from mismatch_probe.engines.forward.scoring import BatchGrid
from mismatch_probe.rundir.records import ScoreRequest

# Padded grid cells per micro-batch: bounds the activations kept for the backward pass.
MICRO_BATCH_CELLS = 16384


def token_logprobs(hf, batch: list[ScoreRequest], temperature: float, pad_id: int) -> torch.Tensor:
    """ℓ = log_softmax(logits / T)[token] of every scored position of `batch`, flat in request order
    (the order of `BatchGrid.targets`), with gradient when enabled."""
    # Right padding: causal attention keeps the padding out of every real position, and each
    # sequence starts at column 0, so its position ids are 0, 1, 2... as the mask's cumsum says.
    grid = BatchGrid.right_padded(batch)
    attention = torch.from_numpy(grid.real()).long()
    hidden = hf.model(
        input_ids=grid.tokens(batch, pad_id),
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
    ).last_hidden_state
    targets = grid.targets(batch)
    rows, columns, token_ids = (torch.from_numpy(a) for a in (targets.rows, targets.columns, targets.token_ids))
    logits = hf.lm_head(hidden[rows, columns]).float() / temperature
    return logits.log_softmax(-1).gather(-1, token_ids[:, None]).squeeze(-1)


def tis_loss(
    logprob: torch.Tensor, behaviour: np.ndarray, advantage: np.ndarray, tis_cap: float, loss_tokens: int
) -> torch.Tensor:
    """This micro-batch's share of -mean over the whole batch's response tokens of w·A·ℓ, with
    w = min(exp(ℓ - μ), cap) held constant; tokens without a stored μ are left out."""
    mu, adv = torch.from_numpy(behaviour), torch.from_numpy(advantage)
    keep = torch.isfinite(mu)
    ell = logprob[keep]
    weight = torch.exp(ell.detach().double() - mu[keep]).clamp(max=tis_cap)
    return -(weight * adv[keep] * ell.double()).sum() / loss_tokens


def micro_batches(requests: list[ScoreRequest], cells: int = MICRO_BATCH_CELLS) -> list[list[int]]:
    """Indices of `requests`, longest first, cut so that each padded grid holds at most `cells`
    (a longer sequence goes alone): similar lengths together waste little padding."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i]), i))
    batches: list[list[int]] = []
    for i in order:
        # Longest first: a batch's width is its first sequence's length.
        if batches and len(requests[batches[-1][0]]) * (len(batches[-1]) + 1) <= cells:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
