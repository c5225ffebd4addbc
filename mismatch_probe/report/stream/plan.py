"""How a report is cut into units of work for several processes: ranges of sample ids.

A unit is a range of sample ids, [first, end), so every sequence is whole in one unit on every side, however
the sides' parts and row groups are cut: each unit reads, on each side, the row groups whose sample-id
statistics meet its range and keeps the rows inside. The cuts are placed at row-group starts of the first
side so that units hold about equal rows. Only the Parquet footers are read here.

A run too small to be worth other processes, or whose footers do not show every side's row groups in
sample order (no statistics, or ranges out of order), is one unit: the single pass then reads it, and
reports any disorder as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.frames.align import side_columns
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import SampleRange, open_part, require_parts, row_group_samples
from mismatch_probe.schema import RoutingShape

MIN_UNIT_ROWS = 1 << 19  # below this, starting a process costs more than it saves
UNITS_PER_WORKER = 4  # several units per worker even out their speeds, and the progress bar moves


@dataclass(frozen=True)
class Unit:
    index: int
    samples: SampleRange | None  # None: the whole run

    def __str__(self) -> str:
        if self.samples is None:
            return "the whole run"
        first, end = self.samples
        return f"samples {first}.." + ("the end" if end is None else str(end - 1))


WHOLE = Unit(index=0, samples=None)


def _groups(run: Run, side: str, shape: RoutingShape) -> list | None:
    """(min sample id, max, rows) of each row group of the side in reading order; None if some row group has
    no statistics or the row groups' ranges are out of sample order."""
    groups = []
    for part in require_parts(run.side_dir(side)):
        groups += row_group_samples(open_part(part, shape))
    if any(group is None for group in groups):
        return None
    for before, after in zip(groups[:-1], groups[1:]):
        if after[0] < before[1]:  # a sequence may continue into the next row group, no more
            return None
    return groups


def plan_units(run: Run, sides: list[str], shape: RoutingShape, workers: int) -> list[Unit]:
    """The units of a report over `sides` by `workers` processes, in sample order."""
    if workers <= 1:
        return [WHOLE]
    for side in sides:
        side_columns(run, side, shape)  # a side's bad column is one error, before any process starts
    every = [_groups(run, side, shape) for side in sides]
    if any(groups is None for groups in every) or not every[0]:
        return [WHOLE]
    first_side = every[0]
    rows = np.array([group[2] for group in first_side], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    total = int(rows.sum())
    count = min(workers * UNITS_PER_WORKER, total // MIN_UNIT_ROWS, len(first_side))
    if count < 2:
        return [WHOLE]
    targets = total * np.arange(1, count) / count
    picks = np.searchsorted(starts, targets)  # the first row group starting at or after each target
    cuts = sorted({first_side[i][0] for i in picks if i < len(first_side)} - {first_side[0][0]})
    if not cuts:
        return [WHOLE]
    bounds = [0, *cuts, None]
    return [Unit(index=i, samples=(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]
