"""Which comparison the verdict speaks of: the rollout against the matched score set (rundir/roles.py).

The rule, in order (docs/metrics.md#the-verdict):
1. the rollout against a set whose role is `matched` (several: the one of largest k3);
2. no matched set: the rollout against a plain set (no diagnostic role: no replay, repeat, quantization,
   truncated sampling or sweep knob) at the rollout's dtype, the one of largest k3 where there are several;
3. else the rollout against any set without replay, the one of largest k3 (the rule before roles);
4. else any comparison of largest k3.
The verdict line names the rule that chose its comparison, so a reader knows what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mismatch_probe.rundir.roles import MATCHED

if TYPE_CHECKING:
    from mismatch_probe.report.verdict.summary import Row

K3 = "k3_kl"
BY_ROLE = "the matched set"
BY_DTYPE = "no set is marked matched: the plain set at the rollout's dtype"
BY_K3 = "no set is marked matched or plain at the rollout's dtype: the comparison of largest k3"


@dataclass(frozen=True)
class Choice:
    row: Row | None
    rule: str  # which rule chose it, in words the verdict line ends with


@dataclass(frozen=True)
class Candidate:
    """A comparison of the rollout with score sets (or, for locate, one score set), as the rule sees it."""

    item: object  # what is chosen: a summary Row, a locate TrainingSet
    k3: float
    roles: frozenset  # the sets' roles (rundir/roles.py); None: plain
    replayed: bool
    plain_at_rollout_dtype: bool
    against_rollout: bool = True


def plain_at_rollout_dtype(info, rollout) -> bool:
    """A score set (a SideInfo) with no role, at the rollout's dtype (rollout: the rollout's SideInfo)."""
    return info.score_role is None and rollout is not None and bool(rollout.dtype) and info.dtype == rollout.dtype


def pick(candidates: list[Candidate]) -> tuple[object | None, str]:
    """The rule of the module docstring over any candidates: the chosen item and the rule's words."""
    by_k3 = lambda c: c.k3  # noqa: E731
    matched = [c for c in candidates if c.against_rollout and MATCHED in c.roles]
    if matched:
        return max(matched, key=by_k3).item, BY_ROLE
    plain = [c for c in candidates if c.against_rollout and not c.replayed]
    at_dtype = [c for c in plain if c.plain_at_rollout_dtype]
    if at_dtype:
        return max(at_dtype, key=by_k3).item, BY_DTYPE
    best = max(plain or candidates, key=by_k3, default=None)
    return (None if best is None else best.item), BY_K3


def choose(table: list[Row]) -> Choice:
    """The summary row the verdict speaks of."""
    candidates = [
        Candidate(
            item=row,
            k3=row.metrics.get(K3) or 0.0,
            roles=row.roles,
            replayed=row.replayed,
            plain_at_rollout_dtype=row.plain_at_rollout_dtype,
            against_rollout=any(ref == "rollout" for ref, _ in row.names),
        )
        for row in table
    ]
    row, rule = pick(candidates)
    return Choice(row=row, rule=rule)
