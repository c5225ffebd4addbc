"""95% intervals by a Poisson bootstrap over sequences, computed in one streaming pass.

Sequences are the unit sampled independently, so they are what is resampled. In a Poisson(1)
bootstrap each sequence gets an independent Poisson(1) weight in each resample instead of a
multinomial count; a resample's statistic is then a function of weighted per-sequence sums, which
accumulate chunk by chunk in O(resamples) memory per sum. The weight of (sequence, resample) is
a hash of (seed, sample_id, resample): it does not depend on how the rows are cut into chunks or
row groups, so a report is reproducible bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 400
SEED = 0x5EED
CI_SUFFIX = "_ci95"
CI_LEVEL = 0.95

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL_2 = np.uint64(0x94D049BB133111EB)
# P(X <= k) for X ~ Poisson(1), k = 0..19; the tail beyond is below 2**-53, the resolution of the uniforms.
_POISSON_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(20)])


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixed hash of uint64 (array arithmetic wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * _MUL_1
    x = (x ^ (x >> np.uint64(27))) * _MUL_2
    return x ^ (x >> np.uint64(31))


def poisson_weights(sample_ids: np.ndarray, seed: int = SEED, resamples: int = RESAMPLES) -> np.ndarray:
    """[len(sample_ids), resamples] float64 Poisson(1) weights, a pure function of (seed, sample_id, resample)."""
    seed_key = _mix64(np.array([seed], dtype=np.uint64) * _GOLDEN + np.uint64(1))
    per_sequence = _mix64(np.asarray(sample_ids, dtype=np.uint64) * _GOLDEN ^ seed_key)
    streams = per_sequence[:, None] + np.arange(1, resamples + 1, dtype=np.uint64)[None, :] * _GOLDEN
    uniform = (_mix64(streams) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.searchsorted(_POISSON_CDF, uniform, side="right").astype(np.float64)


def interval(resampled: np.ndarray) -> list[float] | None:
    """The 95% percentile interval of the resampled statistic; None when no resample is finite. A very skewed
    resample distribution (one extreme token, say) may leave the point estimate just outside: it is not
    widened to hide that."""
    finite = resampled[np.isfinite(resampled)]
    if finite.size == 0:
        return None
    tail = (1.0 - CI_LEVEL) / 2.0
    low, high = np.quantile(finite, [tail, 1.0 - tail])
    return [float(low), float(high)]


def ci_key(key: str) -> str:
    return key + CI_SUFFIX
