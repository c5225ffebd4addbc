"""Mismatch broken down by position within the response and by the reference probability, streamed.

Each breakdown keeps per-bin sums (np.bincount per chunk), so its memory is O(bins) however long the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.keys.levels import DEFAULT_THRESHOLDS

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

# Bins of p_ref: [0, 1e-3), [1e-3, 1e-2), ..., [0.99, 1] (the last bin includes p = 1).
REF_PROB_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
POSITION_BINS = 24  # initial log2 buckets of the response index (grown when a response is longer)


def position_bucket(index: np.ndarray) -> np.ndarray:
    """log2 bucket of a response index: 0 -> 0, [1, 2) -> 1, [2, 4) -> 2, [2^(b-1), 2^b) -> b."""
    return np.frexp(index.astype(np.float64))[1].astype(np.int64)


def position_edges(n_bins: int) -> list[int]:
    return [0] + [2**b for b in range(n_bins)]


def _grown(values: np.ndarray, rows: int) -> np.ndarray:
    if rows <= len(values):
        return values
    out = np.zeros((max(rows, 2 * len(values)), *values.shape[1:]), dtype=values.dtype)
    out[: len(values)] = values
    return out


@dataclass
class BinnedMismatch:
    """Per-bin token counts, k3 and |delta| sums and threshold exceedances."""

    thresholds: tuple
    n_bins: int
    count: np.ndarray = field(default=None)
    sum_k3: np.ndarray = field(default=None)
    sum_abs: np.ndarray = field(default=None)
    # levels[b, j]: tokens of bin b with max(r, 1/r) above exactly j of the (sorted) thresholds
    levels: np.ndarray = field(default=None)

    def __post_init__(self):
        self.count = np.zeros(self.n_bins, dtype=np.int64)
        self.sum_k3 = np.zeros(self.n_bins)
        self.sum_abs = np.zeros(self.n_bins)
        self.levels = np.zeros((self.n_bins, len(self.thresholds) + 1), dtype=np.int64)

    def _grow(self, size: int) -> None:
        if size > len(self.count):
            self.count, self.sum_k3, self.sum_abs, self.levels = (
                _grown(a, size) for a in (self.count, self.sum_k3, self.sum_abs, self.levels)
            )

    def add(self, bins: np.ndarray, k3: np.ndarray, abs_delta: np.ndarray, level: np.ndarray) -> None:
        self._grow(max(self.n_bins, int(bins.max()) + 1))
        m, width = len(self.count), self.levels.shape[1]
        self.count += np.bincount(bins, minlength=m)
        self.sum_k3 += np.bincount(bins, weights=k3, minlength=m)
        self.sum_abs += np.bincount(bins, weights=abs_delta, minlength=m)
        self.levels += np.bincount(bins * width + level, minlength=m * width).reshape(m, width)

    def merge(self, other: BinnedMismatch) -> None:
        self._grow(len(other.count))
        m = len(other.count)
        self.count[:m] += other.count
        self.sum_k3[:m] += other.sum_k3
        self.sum_abs[:m] += other.sum_abs
        self.levels[:m] += other.levels

    def result(self, edges: list, n_bins: int) -> dict:
        count = self.count[:n_bins]
        has = count > 0

        def means(sums: np.ndarray) -> list:
            return [float(s / n) if h else None for s, n, h in zip(sums, count, has)]

        out = {
            "edges": edges,
            "n_tokens": count.tolist(),
            "k3_kl": means(self.sum_k3[:n_bins]),
            "abs_logprob_diff_mean": means(self.sum_abs[:n_bins]),
        }
        # Tokens above threshold t: those above more sorted thresholds than stand below t.
        above = self.levels[:n_bins, ::-1].cumsum(axis=1)[:, ::-1]  # above[b, j] = tokens with level >= j
        ordered = np.sort(np.array([float(t) for t in self.thresholds]))
        for t in self.thresholds:
            j = int(np.searchsorted(ordered, float(t), side="left"))
            out[EXTREME_FRACTION.at(t)] = means(above[:, j + 1])
        return out


@dataclass
class Breakdowns:
    """`by_response_position` (log2 buckets of the response index) and `by_ref_prob` (bins of p_ref)."""

    thresholds: tuple = DEFAULT_THRESHOLDS
    by_position: BinnedMismatch = field(init=False)
    by_prob: BinnedMismatch = field(init=False)

    def __post_init__(self):
        self.sorted_thresholds = np.sort(np.array([float(t) for t in self.thresholds]))
        self.by_position = BinnedMismatch(thresholds=self.thresholds, n_bins=POSITION_BINS)
        self.by_prob = BinnedMismatch(thresholds=self.thresholds, n_bins=len(REF_PROB_EDGES) - 1)

    def update(self, frame: PairFrame) -> None:
        if frame.compared.size == 0:
            return
        k3, abs_delta = frame.k3, frame.abs_delta
        # The comparison extreme_fraction@t makes (max(r, 1/r) > t), so bins add up to it.
        level = np.searchsorted(self.sorted_thresholds, frame.ratio_max, side="left")
        self.by_position.add(position_bucket(frame.rows.response_index[frame.compared]), k3, abs_delta, level)
        self.by_prob.add(np.searchsorted(REF_PROB_EDGES[1:-1], frame.p_ref, side="right"), k3, abs_delta, level)

    def merge(self, other: Breakdowns) -> None:
        self.by_position.merge(other.by_position)
        self.by_prob.merge(other.by_prob)

    def finish(self) -> dict:
        used = np.flatnonzero(self.by_position.count)
        n_bins = int(used[-1]) + 1 if used.size else 1
        return {
            "breakdowns": {
                "by_response_position": self.by_position.result(position_edges(n_bins), n_bins),
                "by_ref_prob": self.by_prob.result(list(REF_PROB_EDGES), len(REF_PROB_EDGES) - 1),
            }
        }
