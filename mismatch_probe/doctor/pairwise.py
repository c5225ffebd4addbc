"""Streaming over pairs of consecutive rows, mergeable exactly across ranges of rows.

Shift checks (a log-prob or a route one position away) compare row p with row p+1 of the same sample, and
such a pair can straddle two chunks or two ranges of a split report. Each accumulator keeps its range's
first and last row; an update pairs the previous chunk's last row with the new chunk's first, and a merge
pairs the last row of the earlier range with the first of the later one. So no pair is lost or counted
twice, whatever the chunking.
"""

from __future__ import annotations

import numpy as np

Rows = dict[str, np.ndarray]  # columns of consecutive rows; every payload has sample_id and position


def _take(rows: Rows, index: slice) -> Rows:
    return {key: np.array(value[index]) for key, value in rows.items()}  # a copy: chunks are views


def _join(a: Rows, b: Rows) -> Rows:
    return {key: np.concatenate([a[key], b[key]]) for key in a}


def add_counts(counts: np.ndarray, index: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """counts[index] += weights (1 each), growing counts as needed: per-sample tallies, merged by adding."""
    extra = np.bincount(index, weights=weights, minlength=len(counts)).astype(counts.dtype)
    if len(extra) > len(counts):
        counts = np.concatenate([counts, np.zeros(len(extra) - len(counts), counts.dtype)])
    counts += extra
    return counts


def add_arrays(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(a) < len(b):
        a, b = b, a
    out = a.copy()
    out[: len(b)] += b
    return out


class Pairwise:
    """Subclasses give `payload(frame)` (per-row columns), `add_rows(rows)` (per-row statistics, once per
    row), `add_pairs(rows)` (statistics of consecutive pairs in `rows`) and `add_sums(other)`."""

    def __init__(self):
        self.head: Rows | None = None  # first row of the range
        self.tail: Rows | None = None  # last row of the range

    def payload(self, frame) -> Rows | None:
        raise NotImplementedError

    def add_rows(self, rows: Rows) -> None:
        pass

    def add_pairs(self, rows: Rows) -> None:
        raise NotImplementedError

    def add_sums(self, other) -> None:
        raise NotImplementedError

    def update(self, frame) -> None:
        rows = self.payload(frame)
        if rows is None or not len(rows["sample_id"]):
            return
        self.add_rows(rows)
        self.add_pairs(rows)
        if self.tail is not None:
            self.add_pairs(_join(self.tail, _take(rows, slice(0, 1))))
        self.head = self.head if self.head is not None else _take(rows, slice(0, 1))
        self.tail = _take(rows, slice(-1, None))

    def merge(self, other) -> None:
        self.add_sums(other)
        if other.head is None:
            return
        if self.head is None:
            self.head, self.tail = other.head, other.tail
            return
        first, second = (self, other) if _key(self.head) < _key(other.head) else (other, self)
        self.add_pairs(_join(first.tail, second.head))
        self.head, self.tail = first.head, second.tail


def _key(rows: Rows) -> tuple[int, int]:
    return int(rows["sample_id"][0]), int(rows["position"][0])


def same_sample(rows: Rows) -> np.ndarray:
    """[n-1] bool: row j and row j+1 belong to the same sample."""
    return rows["sample_id"][1:] == rows["sample_id"][:-1]
