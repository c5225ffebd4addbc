"""The one interface of every statistic `probe report` streams: update, merge, finish.

An accumulator sees the aligned rows one `PairFrame` at a time, in row order, and keeps only what its
numbers need. Two accumulators of the same comparison that saw different row ranges merge into the one a
single pass over both ranges would give: counts and ranked lists exactly, float sums up to the order of
addition (a few ulps), and the same bootstrap resamples (a sequence's weights hash its sample id), so
intervals too differ by rounding only. So the report can run over ranges of row groups in separate
processes and merge. A sequence may straddle two ranges; the response index cannot be known at the start
of a range that begins inside a response, so such a range's FrameBuilder takes the tracker of the range
before. `finish` is called once, after the last update or merge.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from mismatch_probe.frames.pair_frame import PairFrame

Self = TypeVar("Self", bound="Accumulator")


@runtime_checkable
class Accumulator(Protocol):
    def update(self, frame: PairFrame) -> None:
        """Add one chunk of aligned rows. One accumulator's updates cover a contiguous range of rows, in order."""

    def merge(self: Self, other: Self) -> None:
        """Add what `other` accumulated over another range of rows (before or after this one's)."""

    def finish(self) -> dict:
        """This statistic's part of the comparison's JSON: top-level keys, the headline numbers under "metrics"."""
