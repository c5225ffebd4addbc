"""Token log-probs when the LM head is split over tensor-parallel ranks by vocabulary.

Each rank holds the logits of one vocabulary slice; the log-softmax normaliser, the target's
logit and the argmax are combined with all-reduces, so no rank ever holds full-vocabulary logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


@torch.no_grad()
def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    project_local: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    chunk: int,
    vocab_start: int,
    group,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as logprobs.gather_logprobs; `project_local` returns this rank's `[rows, V/tp]` logits."""
    n = hidden.shape[0]
    out = (torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float32))
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        lp, tid, tlp = _chunk(project_local(hidden[start:stop]), targets[start:stop], temperature, vocab_start, group)
        out[0][start:stop], out[1][start:stop], out[2][start:stop] = lp.cpu(), tid.cpu(), tlp.cpu()
    return out


def _chunk(local_logits, targets, temperature, vocab_start, group):
    scaled = local_logits.float() / temperature
    local_max, local_arg = scaled.max(dim=-1)
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(scaled - global_max[:, None]).sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    normaliser = global_max + torch.log(sum_exp)

    targets = targets.to(scaled.device)
    local_target = targets - vocab_start
    here = (local_target >= 0) & (local_target < scaled.shape[-1])
    picked = scaled.gather(-1, local_target.clamp(0, scaled.shape[-1] - 1)[:, None]).squeeze(-1)
    picked = torch.where(here, picked, torch.zeros_like(picked))
    dist.all_reduce(picked, group=group)

    # Ties across ranks resolve to the lowest vocabulary id, as a full-vocabulary argmax would.
    candidate = torch.where(local_max == global_max, local_arg + vocab_start, torch.full_like(local_arg, 2**62))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return picked - normaliser, candidate, global_max - normaliser
