"""The RL step of each sample, from the manifest's `steps`: [[step, first_sample, last_sample], ...].

The Recorder and the importers write one range per run of consecutive samples of one step, so a step may
own several ranges (its samples interleaved with another step's). Lookup is a binary search over the
ranges sorted by first sample: no Python loop per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.errors import ProbeError


@dataclass(frozen=True, kw_only=True)
class StepRanges:
    steps: np.ndarray  # [S] distinct step numbers, ascending: the order of metrics.json's "steps"
    first: np.ndarray  # [R] first sample id of each range, ascending
    last: np.ndarray  # [R] last sample id of each range (inclusive)
    index: np.ndarray  # [R] position in `steps` of each range's step

    @classmethod
    def parse(cls, ranges, where: str) -> StepRanges:
        """`ranges` as the manifest holds them; `where` names the manifest in an error."""
        try:
            table = np.array(ranges, dtype=np.int64).reshape(-1, 3)
        except (TypeError, ValueError):
            raise ProbeError(f"{where}: steps: expected [[step, first_sample, last_sample], ...]") from None
        if (table < 0).any() or (table[:, 2] < table[:, 1]).any():
            raise ProbeError(f"{where}: steps: a range has a negative number or ends before it starts")
        table = table[np.argsort(table[:, 1], kind="stable")]
        if (table[1:, 1] <= table[:-1, 2]).any():
            raise ProbeError(f"{where}: steps: two sample-id ranges overlap")
        steps, index = np.unique(table[:, 0], return_inverse=True)
        return cls(steps=steps, first=table[:, 1], last=table[:, 2], index=index)

    def of(self, sample_ids: np.ndarray) -> np.ndarray:
        """[n] position in `steps` of each sample's step; -1 for a sample no range holds."""
        at = np.searchsorted(self.first, sample_ids, side="right") - 1
        inside = (at >= 0) & (sample_ids <= self.last[np.maximum(at, 0)])
        return np.where(inside, self.index[np.maximum(at, 0)], -1)


def label_steps(records, ranges: StepRanges | None) -> None:
    """Each record's `step` from the ranges (None where none holds it): a score set added to a run that
    records steps carries the `step` column too. One lookup per sequence."""
    if ranges is None or not records:
        return
    at = ranges.of(np.array([r.sample_id for r in records], dtype=np.int64))
    for record, i in zip(records, at):
        record.step = int(ranges.steps[i]) if i >= 0 else None


def step_ranges(manifest, where: str) -> StepRanges | None:
    """The run's steps, or None when it records none."""
    ranges = manifest.extra.get("steps")
    return StepRanges.parse(ranges, where) if ranges else None
