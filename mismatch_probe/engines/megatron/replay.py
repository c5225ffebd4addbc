"""R3 in megatron-core where the rollout has routing, free routing where it has none.

megatron-core's REPLAY_FORWARD forces the target ids on every token of the batch. The training
contract (engines/forward/scoring.py) forces them only where a request carries valid replay experts and
lets the router choose for itself elsewhere (the last sampled token, requests without replay), in
the same forward, as the hf engine does. So for one forward each router's top-k selection takes
the target ids on forced tokens and its own top-k on the rest. Gate weights are gathered from the
router's scores at the chosen ids, exactly as REPLAY_FORWARD gathers them.

Every router call also leaves its selection margin (k-th minus (k+1)-th score, the score as the
family's HF router defines it), taken from the scores its top-k sees, before any replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from mismatch_probe.model.moe.margin import selection_margin
from mismatch_probe.model.moe.sigmoid_bias import group_limited_scores


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


@dataclass(frozen=True)
class MarginRule:
    """How megatron's top-k input becomes the score the family's HF router ranks experts by."""

    top_k: int
    softmax_first: bool = False  # the top-k runs on logits while HF ranks softmax probabilities
    groups: int | None = None  # group-limited top-k: (number of groups, groups kept)
    groups_kept: int | None = None

    def margin(self, scores: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(scores, dim=-1, dtype=torch.float32) if self.softmax_first else scores.float()
        if self.groups_kept:
            scores = group_limited_scores(scores, self.groups, self.groups_kept, self.top_k // self.groups_kept)
        return selection_margin(scores, self.top_k)


@contextmanager
def capture_margins(instances: list, rule: MarginRule) -> Iterator[list[list[torch.Tensor]]]:
    """Per router call, the `[tokens]` margin of the scores its top-k sees, whether it then replays or not."""
    margins: list[list[torch.Tensor]] = [[] for _ in instances]
    for instance, calls in zip(instances, margins):
        instance.get_replay_topk = _recording_margin(instance.get_replay_topk, calls, rule)
    try:
        yield margins
    finally:
        for instance in instances:
            inner = instance.get_replay_topk.inner
            if getattr(inner, "__self__", None) is instance:  # the class method: drop the instance attribute
                del instance.get_replay_topk
            else:
                instance.get_replay_topk = inner


def _recording_margin(inner, calls: list, rule: MarginRule):
    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        calls.append(rule.margin(scores.detach()))
        return inner(scores, topk, num_groups, group_topk, default_compute_topk)

    get_replay_topk.inner = inner
    return get_replay_topk
