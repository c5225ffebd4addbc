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


def _k3(row: Row) -> float:
    return row.metrics.get(K3) or 0.0


def _against_rollout(row: Row) -> bool:
    return any(ref == "rollout" for ref, _ in row.names)


def choose(table: list[Row]) -> Choice:
    matched = [r for r in table if _against_rollout(r) and MATCHED in r.roles]
    if matched:
        return Choice(max(matched, key=_k3), BY_ROLE)
    plain = [r for r in table if _against_rollout(r) and not r.replayed]
    at_dtype = [r for r in plain if r.plain_at_rollout_dtype]
    if at_dtype:
        return Choice(max(at_dtype, key=_k3), BY_DTYPE)
    return Choice(max(plain or table, key=_k3, default=None), BY_K3)
