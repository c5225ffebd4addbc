"""The step where the mismatch changed: a single change-point on per-step ln k3.

The split is the one that minimises the within-regime sum of squares of ln k3 (each regime its own mean),
over every split leaving at least MIN_REGIME usable steps on each side: the least-squares fit of one step
function, computed from prefix sums for every split at once. A split is only a candidate; it is named when
the regimes' k3, each pooled over its tokens, differ beyond noise: the after-interval wholly above (below)
the before-interval and the ratio's interval wholly above `min_ratio` (below 1/min_ratio). The intervals
come from the report's bootstrap, which resamples sequences within steps. A flat run's best split has a
ratio near 1, so it gives None however narrow the intervals.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.frames.bootstrap import interval
from mismatch_probe.report.steps.log_k3 import log_k3, pooled, usable

MIN_REGIME = 2
METHOD = "least-squares single change-point on per-step ln k3; bootstrap over sequences within steps"


def best_split(y: np.ndarray, min_regime: int = MIN_REGIME) -> tuple[int, float] | None:
    """(j, sum of squares): y[:j] and y[j:] as two regimes, the split with the least sum of squares."""
    n = len(y)
    if n < 2 * min_regime:
        return None
    s1, s2 = np.r_[0.0, np.cumsum(y)], np.r_[0.0, np.cumsum(y * y)]
    j = np.arange(min_regime, n - min_regime + 1)
    left = s2[j] - s1[j] ** 2 / j
    right = (s2[n] - s2[j]) - (s1[n] - s1[j]) ** 2 / (n - j)
    best = int(np.argmin(left + right))
    return int(j[best]), float((left + right)[best])


def linear_residual(x: np.ndarray, y: np.ndarray) -> float:
    """Sum of squares left by a straight line through (x, y): a slow rise fits it as well as a step."""
    slope, intercept = np.polyfit(x, y, 1)
    return float(((y - (slope * x + intercept)) ** 2).sum())


def change_point(steps, k3_sums, counts, rk3, rn) -> dict | None:
    """The best split's regimes, named or not: what `drift` judges, and what `probe gate --max-drift`
    judges against its own limit. steps [S] ascending; k3_sums, counts [S]; rk3, rn [S, resamples]."""
    ok = usable(k3_sums, counts)
    y = log_k3(k3_sums[ok], counts[ok])
    split = best_split(y)
    if split is None:
        return None
    j, residual = split
    first_after = ok[j]
    before_at, after_at = np.arange(first_after), np.arange(first_after, len(steps))
    before, before_r = pooled(k3_sums, counts, rk3, rn, before_at)
    after, after_r = pooled(k3_sums, counts, rk3, rn, after_at)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_r = after_r / before_r
    before_ci, after_ci, ratio_ci = interval(before_r), interval(after_r), interval(ratio_r)
    if before_ci is None or after_ci is None or ratio_ci is None:
        return None
    x = steps[ok].astype(np.float64)
    return {
        "step": int(steps[first_after]),
        "direction": "rise" if after > before else "drop",
        "k3_kl_before": float(before),
        "k3_kl_before_ci95": before_ci,
        "k3_kl_after": float(after),
        "k3_kl_after_ci95": after_ci,
        "ratio": float(after / before),
        "ratio_ci95": ratio_ci,
        # a step function that fits better than a line: a sudden change, not a slow one
        "shape": "jump" if residual < linear_residual(x, y) else "gradual",
        "method": METHOD,
    }


def beyond(candidate: dict, min_ratio: float) -> bool:
    """A change beyond noise and beyond `min_ratio`: the regimes' intervals apart, the ratio's wholly past it."""
    before, after, ratio = candidate["k3_kl_before_ci95"], candidate["k3_kl_after_ci95"], candidate["ratio_ci95"]
    if candidate["direction"] == "rise":
        return after[0] > before[1] and ratio[0] > min_ratio
    return after[1] < before[0] and ratio[1] < 1.0 / min_ratio


def drift(candidate: dict | None, min_ratio: float) -> dict | None:
    """The change named, or None."""
    if candidate is None or not beyond(candidate, min_ratio):
        return None
    return {**candidate, "min_ratio": float(min_ratio)}
