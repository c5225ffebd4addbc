"""Per-sequence sums streamed over rows sorted by sample id, handed out once each sequence is complete.

A chunk's rows are reduced to one column of sums per sequence (`segment_sums` over `ChunkRows.segment`).
Rows arrive sorted by (sample_id, position), so a sequence is complete once a later one has begun, except
two: the first sequence of an accumulator's range (it may have begun in the range before) and the last one
seen (it may go on). Those stay open, keyed by sample id, until `close`; merging two ranges adds the open
sums of a sequence they share. Nothing is indexed by sample id, so sparse ids cost nothing. With
`combine=np.maximum` the same bookkeeping carries per-sequence maxima (`segment_maxima`) instead of sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class OpenSequences:
    head: int | None = None  # the first sample id of this range
    open: dict[int, np.ndarray] = field(default_factory=dict)  # sample id -> [width] sums so far
    combine: Callable = np.add  # how two pieces of one sequence join: np.add for sums, np.maximum for maxima

    def add(self, ids: np.ndarray, sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids: [m] sample ids of one chunk's sequences, ascending; sums: [width, m] their sums in the chunk.
        Returns (ids, [width, k] sums) of the sequences now known to be complete."""
        if len(ids) == 0:
            return _none(sums.shape[0])
        first, last = int(ids[0]), int(ids[-1])
        if self.head is None:
            self.head = first
        if first in self.open:  # the chunk continues a sequence of the chunk before
            sums = sums.copy()
            sums[:, 0] = self.combine(sums[:, 0], self.open.pop(first))
        earlier = [sid for sid in self.open if sid != self.head]  # passed by this chunk: complete
        done = (ids != self.head) & (ids != last)
        closed_ids = np.concatenate([np.array(earlier, dtype=np.int64), ids[done]])
        closed = np.hstack(
            [np.stack([self.open.pop(sid) for sid in earlier], axis=1) if earlier else sums[:, :0], sums[:, done]]
        )
        for j in np.flatnonzero(~done):
            self.open[int(ids[j])] = sums[:, j].copy()
        return closed_ids, closed

    def merge(self, other: OpenSequences) -> None:
        for sid, sums in other.open.items():
            self.open[sid] = self.combine(self.open[sid], sums) if sid in self.open else sums.copy()
        if self.head is None or (other.head is not None and other.head < self.head):
            self.head = other.head

    def close(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Every sequence still open, in sample-id order: at the end of the run they are complete."""
        if not self.open:
            return _none(width)
        ids = np.array(sorted(self.open), dtype=np.int64)
        sums = np.stack([self.open.pop(int(sid)) for sid in ids], axis=1)
        return ids, sums


def segment_sums(values: np.ndarray, segment: np.ndarray, m: int) -> np.ndarray:
    """[columns, m] sums of values [columns, n] over each of m segments; `segment` [n] is ascending, as rows
    are. One reduceat over contiguous runs: several times faster than a weighted np.bincount per column."""
    return _reduce_segments(np.add, values, segment, m, 0.0)


def segment_maxima(values: np.ndarray, segment: np.ndarray, m: int) -> np.ndarray:
    """[columns, m] maxima of values [columns, n] over each of m segments (ascending `segment`); -inf where empty."""
    return _reduce_segments(np.maximum, values, segment, m, -np.inf)


def _reduce_segments(ufunc, values: np.ndarray, segment: np.ndarray, m: int, empty: float) -> np.ndarray:
    out = np.full((values.shape[0], m), empty)
    starts = np.searchsorted(segment, np.arange(m))
    filled = np.diff(np.r_[starts, values.shape[1]]) > 0  # reduceat would give an empty run a value: skip them
    if filled.any():
        out[:, filled] = ufunc.reduceat(values, starts[filled], axis=1)
    return out


def _none(width: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.int64), np.zeros((width, 0))
