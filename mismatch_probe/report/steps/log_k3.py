"""Per-step ln k3, the scale drift and trend are fitted on: a ×5 jump is the same step whatever the level."""

from __future__ import annotations

import numpy as np


def usable(k3_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions of the steps whose k3 has a logarithm: some tokens, not all exactly equal on both sides."""
    return np.flatnonzero((counts > 0) & (k3_sums > 0))


def log_k3(k3_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """ln(k3 sum / tokens), elementwise; works on [steps] totals and [steps, resamples] resampled sums alike."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(k3_sums / counts)


def pooled(k3_sums: np.ndarray, counts: np.ndarray, rk3: np.ndarray, rn: np.ndarray, at: np.ndarray):
    """k3 pooled over the tokens of the steps `at` (not a mean of step means), and its [resamples] values."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return k3_sums[at].sum() / counts[at].sum(), rk3[at].sum(axis=0) / rn[at].sum(axis=0)
