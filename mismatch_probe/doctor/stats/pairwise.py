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


def take_rows(rows: Rows, index: slice) -> Rows:
    return {key: np.array(value[index]) for key, value in rows.items()}  # a copy: chunks are views


def join_rows(a: Rows, b: Rows) -> Rows:
    return {key: np.concatenate([a[key], b[key]]) for key in a}


class SampleCounts:
    """Counts per sample id, sparse: sample ids need not be dense (readers never size a table by the
    largest id). Each update appends its (ids, counts); they are summed per id when many have piled up,
    at merge and at the end, so a sample split across chunks or ranges counts once."""

    COMPACT = 64

    def __init__(self):
        self.ids: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []

    def add(self, index: np.ndarray) -> None:
        if len(index):
            ids, counts = np.unique(index, return_counts=True)
            self.ids.append(ids.astype(np.int64))
            self.counts.append(counts.astype(np.int64))
            if len(self.ids) > self.COMPACT:
                self.compact()

    def merge(self, other: SampleCounts) -> None:
        self.ids += other.ids
        self.counts += other.counts
        self.compact()

    def compact(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.ids:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids, inverse = np.unique(np.concatenate(self.ids), return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate(self.counts), minlength=len(ids)).astype(np.int64)
        self.ids, self.counts = [ids], [counts]
        return ids, counts

    def on(self, universe: np.ndarray) -> np.ndarray:
        """The counts of each id of `universe` (sorted; 0 where none)."""
        ids, counts = self.compact()
        out = np.zeros(len(universe), np.int64)
        if len(ids):
            out[np.searchsorted(universe, ids)] = counts
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
            self.add_pairs(join_rows(self.tail, take_rows(rows, slice(0, 1))))
        self.head = self.head if self.head is not None else take_rows(rows, slice(0, 1))
        self.tail = take_rows(rows, slice(-1, None))

    def merge(self, other) -> None:
        self.add_sums(other)
        if other.head is None:
            return
        if self.head is None:
            self.head, self.tail = other.head, other.tail
            return
        first, second = (self, other) if first_key(self.head) < first_key(other.head) else (other, self)
        self.add_pairs(join_rows(first.tail, second.head))
        self.head, self.tail = first.head, second.tail


def first_key(rows: Rows) -> tuple[int, int]:
    return int(rows["sample_id"][0]), int(rows["position"][0])


def same_sample(rows: Rows) -> np.ndarray:
    """[n-1] bool: row j and row j+1 belong to the same sample."""
    return rows["sample_id"][1:] == rows["sample_id"][:-1]
