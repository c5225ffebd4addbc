"""The slope of per-step ln k3 against the step number, with a bootstrap interval.

Least squares over the steps that have tokens; each bootstrap resample refits the line through that
resample's per-step ln k3 (sequences resampled within steps; a step left without weight sits that resample
out), so the interval carries the noise of every step's estimate. A slope of 0.05 is k3 growing about 5 % per step. Reported whenever three steps have
tokens: an interval holding 0 says the run shows no trend.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.frames.bootstrap import interval
from mismatch_probe.report.steps.log_k3 import log_k3, usable

MIN_STEPS = 3


def slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of each column of y [points, ...] against x [points], each column over its
    finite points only (a resample that gives a step no weight leaves that step out of its fit); NaN
    where fewer than MIN_STEPS points remain."""
    x = np.broadcast_to(x.reshape((-1,) + (1,) * (y.ndim - 1)), y.shape)
    seen = np.isfinite(y)
    n = seen.sum(axis=0)
    xs, ys = np.where(seen, x, 0.0), np.where(seen, y, 0.0)
    sx, sy = xs.sum(axis=0), ys.sum(axis=0)
    sxx, sxy = (xs * xs).sum(axis=0), (xs * ys).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return np.where(n >= MIN_STEPS, slope, np.nan)


def trend(steps, k3_sums, counts, rk3, rn) -> dict | None:
    ok = usable(k3_sums, counts)
    if len(ok) < MIN_STEPS:
        return None
    x = steps[ok].astype(np.float64)
    slope = slopes(x, log_k3(k3_sums[ok], counts[ok]))
    resampled = log_k3(rk3[ok], rn[ok])  # [steps, resamples]; NaN or -inf where a step got no weight
    resampled[~np.isfinite(resampled)] = np.nan
    return {"slope": float(slope), "slope_ci95": interval(slopes(x, resampled))}
