"""Noise-aware gate checks: a limit on the upper end of a 95% interval, and a comparison with a baseline run.

Against a baseline, a metric fails only when the candidate's interval lies entirely above the
baseline's: the candidate's lower end exceeds the baseline's upper end (non-overlapping 95%
intervals). Two independent estimates whose intervals do not overlap differ at well below the 5%
level, so a failure is a real regression and not run-to-run noise; a smaller regression that the
intervals cannot resolve passes (sample more sequences to resolve it).
"""

from __future__ import annotations

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report.keys.catalogue import declared


def interval_of(metrics: dict, key: str) -> list[float] | None:
    """KEY_ci95 as [low, high], None when absent or null (metrics_file.read_metrics checked its shape)."""
    ci = metrics.get(ci_key(key))
    return None if ci is None else [float(ci[0]), float(ci[1])]


def upper_end(metrics: dict, key: str) -> tuple[float | None, str]:
    """The value --use-ci-upper checks: the interval's upper end, or the point value for keys without one."""
    ci = interval_of(metrics, key)
    return (ci[1], "ci95_upper") if ci is not None else (metrics.get(key), "value")


def baseline_keys(comparisons: list[dict], named: list[str]) -> list[str]:
    """The keys compared with the baseline: those named by --max that have intervals, else every key present
    that the catalogue checks against a baseline by default (higher means more mismatch)."""
    with_interval = [key for key in named if any(ci_key(key) in comp["metrics"] for comp in comparisons)]
    if with_interval:
        return with_interval
    present = dict.fromkeys(key for comp in comparisons for key in comp["metrics"])
    return [key for key in present if (entry := declared(key)) is not None and entry.gate_baseline]


def regression(candidate: dict, baseline: dict, key: str, where: str, baseline_where: str) -> tuple[str, dict]:
    """(status, fields) of one baseline check: fail when the candidate's interval lies above the baseline's."""
    value, base = candidate.get(key), baseline.get(key)
    ci, base_ci = interval_of(candidate, key), interval_of(baseline, key)
    fields = dict(
        value=value, ci95=ci, baseline=base, baseline_ci95=base_ci, limit=None if base_ci is None else base_ci[1]
    )
    if value is None or base is None:
        return "skipped", fields
    for ends, path in ((ci, where), (base_ci, baseline_where)):
        if ends is None:
            raise ProbeError(f"{path}: {key} has no {ci_key(key)} interval; re-run `probe report` to compute it")
    return ("fail" if ci[0] > base_ci[1] else "pass"), fields
