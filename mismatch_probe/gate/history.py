"""`probe gate RUN --history DIR ...`: the run against earlier runs of the same setup (as miles gates its CI
against trusted history). A key fails when the run's 95% interval lies wholly above every history run's:
its lower end above the largest upper end among them. One earlier run is a baseline (gate/stats.py); a
history needs enough runs to say what "normal" spans, so with fewer than MIN_RUNS the gate says so and
checks nothing, failing only under --strict."""

from __future__ import annotations

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.gate.stats import interval_of
from mismatch_probe.report.keys.families import EXTREME_FRACTION

MIN_RUNS = 3
HISTORY = "history"  # the `checked` of a history check
DEFAULT_KEYS = ("k3_kl", EXTREME_FRACTION.at(2))


def history_keys(comparisons: list[dict], named: list[str]) -> list[str]:
    """The --max keys that have intervals, else k3 and F(2)."""
    with_interval = [key for key in named if any(ci_key(key) in comp["metrics"] for comp in comparisons)]
    return with_interval or [key for key in DEFAULT_KEYS if any(key in comp["metrics"] for comp in comparisons)]


def history_checks(comparisons: list[dict], history: list[tuple[str, list[dict]]], keys, strict: bool, make_check):
    """history: (label, comparisons) of each earlier run. One check per (comparison, key); with too few
    runs, one check that says so instead (a pass, or a failure under --strict)."""
    if len(history) < MIN_RUNS:
        status = "fail" if strict else "pass"
        return [
            make_check(
                reference="history",
                candidate=f"{len(history)} run{'s' if len(history) != 1 else ''}",
                metric="history runs",
                limit=float(MIN_RUNS),
                value=float(len(history)),
                status=status,
                checked=HISTORY,
            )
        ]
    checks = []
    for comp in comparisons:
        pair = (comp["reference"], comp["candidate"])
        for key in keys:
            value, ci = comp["metrics"].get(key), interval_of(comp["metrics"], key)
            uppers = []
            for label, others in history:
                theirs = next((c["metrics"] for c in others if (c["reference"], c["candidate"]) == pair), None)
                if theirs is None or theirs.get(key) is None:
                    continue
                their_ci = interval_of(theirs, key)
                if their_ci is None:
                    raise ProbeError(f"{label}: {pair[0]} vs {pair[1]}: {key} has no {ci_key(key)} interval")
                uppers.append(their_ci[1])
            if value is not None and ci is None:
                raise ProbeError(f"{pair[0]} vs {pair[1]}: {key} has no {ci_key(key)} interval")
            enough = value is not None and len(uppers) >= MIN_RUNS
            checks.append(
                make_check(
                    reference=pair[0],
                    candidate=pair[1],
                    metric=key,
                    limit=max(uppers) if uppers else None,
                    value=value,
                    ci95=ci,
                    status=("fail" if ci[0] > max(uppers) else "pass") if enough else "skipped",
                    checked=HISTORY,
                )
            )
    return checks
