"""`probe gate RUN --max-drift R`: fail a comparison whose k3 rose over the run's steps by more than R,
beyond noise: at the report's best change-point (report/steps/drift.py), the after-regime's interval lies
above the before-regime's and the ratio's interval lower end above R, whatever ratio the report itself
names drifts at. A drop (a fix landing mid-run) never fails. The limit stands alone: no --max is needed."""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.trust import check_limit
from mismatch_probe.report.steps.drift import beyond

DRIFT = "drift"  # the metric name and the `checked` of a drift check


def parse_max_drift(value) -> float | None:
    if value is None:
        return None
    limit = check_limit(float(value), "--max-drift")
    if limit < 1:
        raise ProbeError(f"--max-drift: {value} is below 1; a rise's ratio is above 1, e.g. --max-drift 2")
    return limit


def drift_checks(path: Path, comparisons: list[dict], limit: float, make_check) -> list:
    """One check per comparison; make_check builds a gate Check from keywords."""
    if not any("steps" in comp for comp in comparisons):
        raise ProbeError(
            f"{path}: no per-step metrics, so --max-drift has nothing to check: the run records no steps "
            "(Recorder step=, or an import with steps), or its report predates them (re-run `probe report`)"
        )
    checks = []
    for comp in comparisons:
        # the report's best split, judged against this limit (the report's own ratio may be another)
        drift = comp.get("change_point", comp.get("drift"))
        if drift is not None and not beyond(drift, max(limit, 1.0)):
            drift = None
        rise = drift is not None and drift.get("direction") == "rise"
        ci = drift.get("ratio_ci95") if drift else None
        checks.append(
            make_check(
                reference=comp["reference"],
                candidate=comp["candidate"],
                metric=DRIFT,
                limit=limit,
                value=drift["ratio"] if drift else None,
                ci95=ci,
                status="fail" if rise and ci is not None and ci[0] > limit else "pass",
                checked=DRIFT,
                step=drift["step"] if drift else None,
            )
        )
    return checks
