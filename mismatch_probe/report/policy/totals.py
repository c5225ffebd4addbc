"""Per-sequence sums of named per-token columns, with a value and a 95% bootstrap interval for any formula
over their totals: the policy keys' arithmetic, as sequence_stats.py does it for the engine keys.

Sequences are the unit resampled (bootstrap.py); a sequence cut between chunks stays open until complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mismatch_probe.frames.bootstrap import RESAMPLES, ci_key, interval, poisson_weights
from mismatch_probe.frames.sequence_sums import OpenSequences, segment_sums


@dataclass
class Totals:
    columns: tuple[str, ...]
    totals: np.ndarray = field(default=None)
    resampled: np.ndarray = field(default=None)  # [columns, resamples]
    sequences: OpenSequences = field(default_factory=OpenSequences)

    def __post_init__(self):
        if self.totals is None:
            self.totals = np.zeros(len(self.columns))
            self.resampled = np.zeros((len(self.columns), RESAMPLES))

    def add(self, rows, segment: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """One chunk: `values` per compared token (every column named), `segment` the chunk sequence of each."""
        ids = rows.segment_ids
        if len(ids) == 0:
            return
        stacked = np.array([np.asarray(values[name], dtype=np.float64) for name in self.columns])
        sums = segment_sums(stacked.reshape(len(self.columns), -1), segment, len(ids))
        closed, done = self.sequences.add(ids, sums)
        self._add(closed, done, rows.weights_of(closed) if len(closed) else None)

    def _add(self, ids: np.ndarray, sums: np.ndarray, weights: np.ndarray | None = None) -> None:
        if len(ids) == 0:
            return
        self.totals += sums.sum(axis=1)
        self.resampled += sums @ (poisson_weights(ids) if weights is None else weights)

    def merge(self, other: Totals) -> None:
        self.totals += other.totals
        self.resampled += other.resampled
        self.sequences.merge(other.sequences)

    def close(self) -> None:
        self._add(*self.sequences.close(len(self.columns)))

    def metrics(self, formulas: dict[str, Callable[[dict], np.ndarray]]) -> dict:
        """Each formula's value over the totals and its `KEY_ci95` over the resamples; null where not finite."""
        point = dict(zip(self.columns, self.totals))
        resampled = dict(zip(self.columns, self.resampled))
        out = {}
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for key, formula in formulas.items():
                value = float(formula(point))
                out[key] = value if np.isfinite(value) else None
                out[ci_key(key)] = None if out[key] is None else interval(np.asarray(formula(resampled)))
        return out
