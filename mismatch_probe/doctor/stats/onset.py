"""position_onset: |delta| by absolute position, flat up to a position P and a step above it after.

An fp8 KV cache (vLLM#54035, flash-attention PR #184) or an attention kernel whose tiles change the
reduction order from some position on leaves the two sides bitwise equal, or at their ordinary gap, up to P
and apart after. Per position, the compared tokens, their sum of |delta| and of its square are streamed
(additive, so ranges merge exactly); at the end every split point P is tried and the strongest step kept.
"""

from __future__ import annotations

import math

import numpy as np

# Clean runs drift up to about 1.5x from early to late positions, and a shift in level of that size is
# significant on a large run: a step must be 2.5x the level before it, far from the drift, and significant;
# on a small run the lower end of the level after must be 2.5x the upper end of the level before.
ONSET_RATIO = 2.5
ONSET_Z = 6.0  # standard errors between the levels after and before
ONSET_SHARE = 0.05  # each side of P holds at least this share of the compared tokens
# ... and at least this many: with fewer, the level before P is that of whichever prompts' first response
# tokens sit there (measured on tiny clean demos: 7.7x and 8.5x at position 7, on under 50 tokens before it)
ONSET_MIN_TOKENS = 64
Z95 = 1.959964


class PositionLevels:
    def __init__(self):
        self.sums = np.zeros((3, 0))  # tokens, sum |delta|, sum |delta|^2 per position

    def update(self, frame) -> None:
        if not len(frame.compared):
            return
        position = frame.rows.position[frame.compared].astype(np.int64)
        size = int(position.max()) + 1
        if size > self.sums.shape[1]:
            self.sums = np.pad(self.sums, ((0, 0), (0, size - self.sums.shape[1])))
        a = frame.abs_delta
        for row, weights in enumerate((None, a, a * a)):
            self.sums[row, :size] += np.bincount(position, weights=weights, minlength=size)

    def merge(self, other: PositionLevels) -> None:
        if other.sums.shape[1] > self.sums.shape[1]:
            self.sums, other_sums = other.sums.copy(), self.sums
        else:
            other_sums = other.sums
        self.sums[:, : other_sums.shape[1]] += other_sums

    def finish(self) -> dict:
        return {"position_sums": self.sums}


def _level(n: float, total: float, squares: float) -> dict:
    mean = total / n
    se = math.sqrt(max(squares / n - mean * mean, 0.0) / n)
    return {"mean_abs_delta": mean, "ci95": [mean - Z95 * se, mean + Z95 * se], "n_tokens": int(n), "se": se}


def find_onset(sums: np.ndarray) -> dict | None:
    """The split position P (tokens at positions >= P are after it) whose step up in mean |delta| is the most
    significant among those at least ONSET_RATIO high; None when there is no such step."""
    n, total, squares = sums
    before = np.cumsum(sums, axis=1)[:, :-1]  # before[:, j]: positions < j + 1
    after = sums.sum(axis=1)[:, None] - before
    least = max(ONSET_MIN_TOKENS, ONSET_SHARE * n.sum())
    ok = (before[0] >= least) & (after[0] >= least)
    if not ok.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_b, mean_a = before[1] / before[0], after[1] / after[0]
        var_b = np.maximum(before[2] / before[0] - mean_b**2, 0.0) / before[0]
        var_a = np.maximum(after[2] / after[0] - mean_a**2, 0.0) / after[0]
        z = (mean_a - mean_b) / np.sqrt(var_a + var_b)
        # the step must hold between the intervals, not only the means: on a small clean run the positions
        # before P belong to the short prompts' responses, and a level that differs by prompt looks like a step
        high = mean_a - Z95 * np.sqrt(var_a) >= ONSET_RATIO * (mean_b + Z95 * np.sqrt(var_b))
    candidates = np.flatnonzero(ok & high & (z >= ONSET_Z))
    if not len(candidates):
        return None
    j = int(candidates[np.argmax(z[candidates])])
    ratio = float(mean_a[j] / mean_b[j]) if mean_b[j] > 0 else math.inf
    return {
        "onset_position": j + 1,
        "before": _level(*before[:, j]),
        "after": _level(*after[:, j]),
        "ratio": ratio,
        "z": float(z[j]),
    }
