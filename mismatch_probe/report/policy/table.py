"""The staleness table: one row per policy comparison, by step then replay (none, r2, r3), with the columns
the page and the terminal show. Values are metrics.json's own; only 2 Cov(a, s) is derived (twice the
covariance and its interval), so the variance split reads as a sum: Var t = Var a + Var s + 2 Cov."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report.keys.families import ROUTER_SHIFT_CLIP_FRACTION
from mismatch_probe.report.keys.levels import GAMMA_MIN
from mismatch_probe.report.policy.kind import policy_indices

TWO_COV = "2_tid_stale_log_ratio_cov"  # derived here, not a metrics.json key
COLUMNS = (  # (header, key)
    ("tid k3", "tid_k3_kl"),
    ("stale k3", "k3_kl"),
    ("total k3", "total_k3_kl"),
    ("Var a", "tid_log_ratio_var"),
    ("Var s", "stale_log_ratio_var"),
    ("2 Cov", TWO_COV),
    ("Var t", "total_log_ratio_var"),
    ("replay bias k3", "replay_bias_k3_kl"),
    ("override rate", "replay_override_rate"),
    ("mean γ", "router_shift_ratio_mean"),
    (f"P(γ < {GAMMA_MIN})", ROUTER_SHIFT_CLIP_FRACTION.at(GAMMA_MIN)),
)
HEADER = ("step", "replay", *(header for header, _ in COLUMNS))


@dataclass(frozen=True)
class StalenessRow:
    index: int  # into metrics["comparisons"]
    step: int | None
    replay: str
    metrics: dict  # the comparison's metrics, with TWO_COV added

    @property
    def step_text(self) -> str:
        return "—" if self.step is None else str(self.step)


def _doubled(value):
    return None if value is None else 2 * value


def staleness_rows(comparisons: list[dict]) -> list[StalenessRow]:
    out = []
    for i in policy_indices(comparisons):
        comp = comparisons[i]
        metrics = dict(comp["metrics"])
        cov, ci = metrics.get("tid_stale_log_ratio_cov"), metrics.get(ci_key("tid_stale_log_ratio_cov"))
        metrics[TWO_COV] = _doubled(cov)
        metrics[ci_key(TWO_COV)] = None if not ci else [_doubled(v) for v in ci]
        out.append(
            StalenessRow(index=i, step=comp.get("policy_step"), replay=comp.get("replay") or "none", metrics=metrics)
        )
    return out
