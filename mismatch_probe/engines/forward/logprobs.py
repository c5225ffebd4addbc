"""Token log-probs from hidden states without a full [tokens, vocab] float32 log-softmax."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mismatch_probe.engines.base import Truncation
from mismatch_probe.engines.forward.host_copy import to_host
from mismatch_probe.engines.forward.truncation import truncated_logprobs
from mismatch_probe.engines.options import option

DEFAULT_CHUNK = 256


@dataclass(frozen=True)
class LogprobOptions:
    """Options of an engine that gathers log-probs from hidden states in chunks."""

    logprob_chunk: int = option(DEFAULT_CHUNK, "positions per LM-head chunk: O(chunk x vocab) float32 at a time", min=1)


@torch.no_grad()
def gather_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    chunk: int = 1024,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, ...]:
    """For `hidden` `[n, h]` and `targets` `[n]`, return float32 `(logprob, top_id, top_logprob)`, and with
    `truncation` (`--sampling rollout`) those renormalised over each position's own support plus its
    `kept_logmass` (engines/forward/truncation.py; a target outside the support gets -inf).

    `project` maps hidden states to logits (the LM head). Only `chunk` rows of logits exist at
    once, so peak memory is O(chunk x vocab), whatever n is.
    """
    n = hidden.shape[0]
    out = [torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float32)]
    if truncation is not None:
        out.append(torch.empty(n, dtype=torch.float32))
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits, picked = project(hidden[start:stop]), targets[start:stop]
        if truncation is None:
            reduced = logprobs_from_logits(logits, picked, temperature)
        else:
            reduced = truncated_logprobs(logits, picked, temperature, truncation)
        for column, values in zip(out, to_host(reduced)):  # one copy per chunk
            column[start:stop] = values
    return tuple(out)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`log_softmax(logits / T)` at `targets` and at the argmax, in float32 (logits `[n, V]`)."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    top_value, top_id = scaled.max(dim=-1)
    picked = scaled.gather(-1, targets.view(-1, 1).to(scaled.device)).squeeze(-1)
    return picked - normaliser, top_id, top_value - normaliser
