"""Which comparisons of metrics.json are policy comparisons: a new policy's pass against its θ_old set. They
measure staleness, not engine mismatch, so the verdict, the summary and the attribution leave them out and
the page shows them in their own section."""

from __future__ import annotations

from mismatch_probe.vocab import REPLAYS

POLICY = "policy"  # a comparison's `kind`; engine comparisons have none


def is_policy(comparison: dict) -> bool:
    return comparison.get("kind") == POLICY


def policy_indices(comparisons: list[dict]) -> list[int]:
    """Indices of the policy comparisons, by step (unnumbered last), then replay none, r2, r3."""

    def order(i: int) -> tuple:
        step, replay = comparisons[i].get("policy_step"), comparisons[i].get("replay")
        rank = REPLAYS.index(replay) if replay in REPLAYS else len(REPLAYS)
        return (step is None, step or 0, rank, i)

    return sorted((i for i, c in enumerate(comparisons) if is_policy(c)), key=order)
