"""The slope of per-step ln k3 against the step number, with a bootstrap interval.

Least squares over the steps that have tokens; each bootstrap resample refits the line through that
resample's per-step ln k3 (sequences resampled within steps), so the interval carries the noise of every
step's estimate. A slope of 0.05 is k3 growing about 5 % per step. Reported whenever three steps have
tokens: an interval holding 0 says the run shows no trend.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.report.bootstrap import interval
from mismatch_probe.report.steps.log_k3 import log_k3, usable

MIN_STEPS = 3


def slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of each column of y [points, ...] against x [points]."""
    dx = x - x.mean()
    return np.tensordot(dx, y - y.mean(axis=0), axes=(0, 0)) / (dx * dx).sum()


def trend(steps, k3_sums, counts, rk3, rn) -> dict | None:
    ok = usable(k3_sums, counts)
    if len(ok) < MIN_STEPS:
        return None
    x = steps[ok].astype(np.float64)
    slope = slopes(x, log_k3(k3_sums[ok], counts[ok]))
    resampled = log_k3(rk3[ok], rn[ok])  # [steps, resamples]; a step with no weight drops its resample
    finite = np.isfinite(resampled).all(axis=0)
    spread = np.full(resampled.shape[1], np.nan)
    spread[finite] = slopes(x, resampled[:, finite])
    return {"slope": float(slope), "slope_ci95": interval(spread)}
