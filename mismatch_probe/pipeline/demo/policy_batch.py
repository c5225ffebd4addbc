"""A stored rollout as a policy-gradient batch: its token ids, the rollout's log-probs μ, each sample's
reward and its group-mean advantage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mismatch_probe.engines.forward.scoring import scored_positions
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.parts import iter_score_requests, read_part
from mismatch_probe.rundir.records import ScoreRequest
from mismatch_probe.schema import RoutingShape

Reward = Callable[[str, str], float]


@dataclass(frozen=True)
class PolicyBatch:
    requests: list[ScoreRequest]  # every sample, in sample-id order
    behaviour: list[np.ndarray]  # μ at each request's scored positions; NaN where the rollout stored none
    rewards: np.ndarray  # [samples] float64
    advantages: np.ndarray  # [samples]: reward minus the mean reward of the samples of the same prompt

    @property
    def loss_tokens(self) -> int:
        """Response tokens with a stored μ: the denominator of the token-mean loss."""
        return int(sum(np.isfinite(mu).sum() for mu in self.behaviour))

    def with_signal(self) -> list[int]:
        """Samples whose tokens carry gradient: a zero advantage multiplies every term of theirs by 0."""
        return [i for i, mu in enumerate(self.behaviour) if self.advantages[i] != 0 and np.isfinite(mu).any()]


def read_policy_batch(rollout: Path, shape: RoutingShape, tokenizer, reward: Reward) -> PolicyBatch:
    """Read the rollout's stored ids and μ; rewards come from the decoded text (never re-tokenized)."""
    requests, behaviour = [], []
    for part, chunk in iter_score_requests(rollout, shape, with_experts=False):
        path = rollout / part
        column = read_part(path, ["logprob"], shape).column("logprob")
        logprob = column.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls (prompt rows) read as NaN
        starts = np.cumsum([0] + [len(r) for r in chunk])
        for request, start in zip(chunk, starts):
            behaviour.append(logprob[start + scored_positions(request)])
        requests += chunk
    prompts: dict[int, str] = {}  # every sample of a prompt id holds the same prompt tokens
    rewards = np.empty(len(requests))
    for i, r in enumerate(requests):
        if r.prompt_id not in prompts:
            prompts[r.prompt_id] = tokenizer.decode(r.token_ids[: r.prompt_len].tolist())
        rewards[i] = reward(prompts[r.prompt_id], tokenizer.decode(r.token_ids[r.prompt_len :].tolist()))
    if not np.isfinite(rewards).all():
        raise ProbeError(f"{rollout}: a reward is not a finite number")
    return PolicyBatch(
        requests=requests, behaviour=behaviour, rewards=rewards, advantages=group_advantages(requests, rewards)
    )


def group_advantages(requests: list[ScoreRequest], rewards: np.ndarray) -> np.ndarray:
    """A = r - mean of r over the samples of the same prompt id."""
    _, group = np.unique([r.prompt_id for r in requests], return_inverse=True)
    means = np.bincount(group, weights=rewards) / np.bincount(group)
    return rewards - means[group]
