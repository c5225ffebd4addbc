"""Mismatch broken down by position within the response and by the reference probability, streamed.

Each breakdown keeps per-bin sums (np.bincount per chunk), so its memory is O(bins) however long the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .metrics import DEFAULT_THRESHOLDS, extreme_key

# Bins of p_ref: [0, 1e-3), [1e-3, 1e-2), ..., [0.99, 1] (the last bin includes p = 1).
REF_PROB_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
POSITION_BINS = 24  # initial log2 buckets of the response index (grown when a response is longer)


def compared_deltas(use: np.ndarray, lp_ref: np.ndarray, lp_cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows compared in a chunk and their delta = logprob_cand - logprob_ref, in float64."""
    rows = np.flatnonzero(use)
    return rows, lp_cand[rows].astype(np.float64) - lp_ref[rows].astype(np.float64)


@dataclass
class ResponseIndex:
    """Index of each row within its sample's response (0 = first response token), carried across chunks,
    since a sequence may be split between chunks. Values on prompt rows are meaningless."""

    last_sample: int = -1
    last_is_response: bool = False
    start: int = 0  # first response position of last_sample

    def update(self, sample_id: np.ndarray, position: np.ndarray, is_response: np.ndarray) -> np.ndarray:
        n = len(sample_id)
        continues = np.empty(n, dtype=bool)  # the row before is a response row of the same sample
        continues[0] = self.last_is_response and int(sample_id[0]) == self.last_sample
        continues[1:] = is_response[:-1] & (sample_id[1:] == sample_id[:-1])
        starts = is_response & ~continues
        latest = np.maximum.accumulate(np.where(starts, np.arange(n), -1))
        start = np.where(latest >= 0, position[np.maximum(latest, 0)].astype(np.int64), self.start)
        self.last_sample, self.last_is_response = int(sample_id[-1]), bool(is_response[-1])
        if self.last_is_response:
            self.start = int(start[-1])
        return position.astype(np.int64) - start


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

    def add(self, bins: np.ndarray, k3: np.ndarray, abs_delta: np.ndarray, level: np.ndarray) -> None:
        size = max(self.n_bins, int(bins.max()) + 1)
        if size > len(self.count):
            self.count, self.sum_k3, self.sum_abs, self.levels = (
                _grown(a, size) for a in (self.count, self.sum_k3, self.sum_abs, self.levels)
            )
        m, width = len(self.count), self.levels.shape[1]
        self.count += np.bincount(bins, minlength=m)
        self.sum_k3 += np.bincount(bins, weights=k3, minlength=m)
        self.sum_abs += np.bincount(bins, weights=abs_delta, minlength=m)
        self.levels += np.bincount(bins * width + level, minlength=m * width).reshape(m, width)

    def result(self, edges: list, n_bins: int) -> dict:
        count = self.count[:n_bins]
        has = count > 0

        def means(sums: np.ndarray) -> list:
            return [float(s / n) if h else None for s, n, h in zip(sums, count, has)]

        out = {"edges": edges, "n_tokens": count.tolist(), "k3_kl": means(self.sum_k3[:n_bins]),
               "abs_logprob_diff_mean": means(self.sum_abs[:n_bins])}  # fmt: skip
        # Tokens above threshold t: those above more sorted thresholds than stand below t.
        above = self.levels[:n_bins, ::-1].cumsum(axis=1)[:, ::-1]  # above[b, j] = tokens with level >= j
        ordered = np.sort(np.array([float(t) for t in self.thresholds]))
        for t in self.thresholds:
            j = int(np.searchsorted(ordered, float(t), side="left"))
            out[extreme_key(t)] = means(above[:, j + 1])
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

    def update(self, rows: np.ndarray, delta: np.ndarray, lp_ref: np.ndarray, response_index: np.ndarray) -> None:
        if rows.size == 0:
            return
        abs_delta = np.abs(delta)
        k3 = np.expm1(delta) - delta
        # The comparison ProbabilityAccumulator makes (max(r, 1/r) > t), so bins add up to extreme_fraction@t.
        level = np.searchsorted(self.sorted_thresholds, np.exp(abs_delta), side="left")
        self.by_position.add(position_bucket(response_index[rows]), k3, abs_delta, level)
        p_ref = np.exp(lp_ref[rows].astype(np.float64))
        self.by_prob.add(np.searchsorted(REF_PROB_EDGES[1:-1], p_ref, side="right"), k3, abs_delta, level)

    def result(self) -> dict:
        used = np.flatnonzero(self.by_position.count)
        n_bins = int(used[-1]) + 1 if used.size else 1
        return {
            "by_response_position": self.by_position.result(position_edges(n_bins), n_bins),
            "by_ref_prob": self.by_prob.result(list(REF_PROB_EDGES), len(REF_PROB_EDGES) - 1),
        }
