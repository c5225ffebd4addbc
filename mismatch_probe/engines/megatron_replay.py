"""R3 in megatron-core where the rollout has routing, free routing where it has none.

megatron-core's REPLAY_FORWARD forces the target ids on every token of the batch. The training
contract (engines/scoring.py) forces them only where a request carries valid replay experts and
lets the router choose for itself elsewhere (the last sampled token, requests without replay), in
the same forward, as the hf engine does. So for one forward each router's top-k selection takes
the target ids on forced tokens and its own top-k on the rest. Gate weights are gathered from the
router's scores at the chosen ids, exactly as REPLAY_FORWARD gathers them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def replay_where_forced(instances: list, ids: np.ndarray, force: np.ndarray, device: torch.device) -> Iterator[None]:
    """Replay `ids` `[b, s, L, k]` on the tokens where `force` `[b, s]` is True; record every choice."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    rows, seq, layers, k = ids.shape
    # megatron's router rows are sequence-major: row r is token (r // b, r % b).
    per_layer = torch.from_numpy(ids).permute(2, 1, 0, 3).reshape(layers, seq * rows, k)
    keep = torch.from_numpy(np.ascontiguousarray(force.T)).reshape(-1).to(device)
    RouterReplay.set_replay_data([layer.contiguous().to(device) for layer in per_layer])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for instance in instances:
        instance.get_replay_topk = _forced_or_own(instance, keep)
    try:
        yield
    finally:
        for instance in instances:
            del instance.get_replay_topk  # back to the class method


def _forced_or_own(instance, keep: torch.Tensor):
    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = torch.where(keep[:, None], instance.target_topk_idx.to(scores.device), own)
        instance.record_indices(chosen)
        return scores.gather(1, chosen), chosen

    return get_replay_topk
