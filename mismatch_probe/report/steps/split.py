"""The report's headline statistics per RL step, accumulated in the report's own streaming pass.

A sequence lies wholly in one step, so each chunk's compared tokens are summed per sequence (as
sequence_stats does) and the sums added to their step's column. The k3 interval resamples sequences within
each step with the report's Poisson weights (bootstrap.py): a resample's weighted sums are linear in each
sequence's pieces, so a sequence cut across chunks, row groups or worker units gets the same weight on every
piece, and `--workers` gives the steps of one pass (floats up to the order of addition).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.report.bootstrap import RESAMPLES, SEED, interval, poisson_weights
from mismatch_probe.report.sequence_sums import segment_sums
from mismatch_probe.report.steps.drift import drift
from mismatch_probe.report.steps.ranges import StepRanges
from mismatch_probe.report.steps.trend import trend

if TYPE_CHECKING:
    from mismatch_probe.report.pair_frame import PairFrame

STEP_THRESHOLD = 2.0  # extreme_fraction@2 per step, whatever thresholds the report was asked for
# per-step sums: compared tokens, then the routed rows
COLUMNS = ("n", "k3", "abs_delta", "extreme", "p_ref", "p_cand", "p_ref2", "p_cand2", "p_cross", "routed", "layers")
C = {name: i for i, name in enumerate(COLUMNS)}
DEFAULT_MIN_RATIO = 1.5


@dataclass
class StepSplit:
    ranges: StepRanges
    num_layers: int = 0  # 0: dense, no router_diff_rate
    min_ratio: float = DEFAULT_MIN_RATIO  # a drift's ratio must clear this (or 1/this for a drop)
    resamples: int = RESAMPLES
    seed: int = SEED
    totals: np.ndarray = field(default=None)  # [columns, steps]
    resampled: np.ndarray = field(default=None)  # [2, steps, resamples]: weighted k3 sums and token counts

    def __post_init__(self):
        n_steps = len(self.ranges.steps)
        if self.totals is None:
            self.totals = np.zeros((len(COLUMNS), n_steps))
            self.resampled = np.zeros((2, n_steps, self.resamples))

    def update(self, frame: PairFrame) -> None:
        ids = frame.rows.segment_ids
        m = len(ids)
        if m == 0:
            return
        step = self.ranges.of(ids)
        sums = np.zeros((len(COLUMNS), m))
        if frame.compared.size:
            p_ref, p_cand = frame.p_ref, frame.p_cand
            values = [frame.k3, frame.abs_delta, frame.ratio_max > STEP_THRESHOLD, p_ref, p_cand]
            values += [p_ref * p_ref, p_cand * p_cand, p_ref * p_cand]
            sums[C["n"]] = np.bincount(frame.segment, minlength=m)
            sums[C["k3"] : C["routed"]] = segment_sums(np.array(values, dtype=np.float64), frame.segment, m)
        routed = frame.routing
        if routed is not None and routed.rows.any():
            at = frame.rows.segment[routed.rows]
            sums[C["routed"]] = np.bincount(at, minlength=m)
            sums[C["layers"]] = np.bincount(at, weights=routed.layers_differing[routed.rows], minlength=m)
        kept = step >= 0  # samples outside every recorded range belong to no step
        if not kept.any():
            return
        steps, at = np.unique(step[kept], return_inverse=True)
        onehot = (at[None, :] == np.arange(len(steps))[:, None]).astype(np.float64)  # [steps in chunk, sequences]
        self.totals[:, steps] += sums[:, kept] @ onehot.T
        weights = poisson_weights(ids[kept], self.seed, self.resamples)  # [sequences, resamples]
        for row, column in enumerate((C["k3"], C["n"])):
            self.resampled[row, steps] += onehot @ (sums[column, kept][:, None] * weights)

    def merge(self, other: StepSplit) -> None:
        self.totals += other.totals
        self.resampled += other.resampled

    def finish(self) -> dict:
        with np.errstate(divide="ignore", invalid="ignore"):
            k3 = self.resampled[0] / self.resampled[1]  # [steps, resamples]
        entries = [self._entry(i, k3[i]) for i in range(len(self.ranges.steps))]
        k3_sums, counts = self.totals[C["k3"]], self.totals[C["n"]]
        return {
            "steps": entries,
            "drift": drift(self.ranges.steps, k3_sums, counts, self.resampled[0], self.resampled[1], self.min_ratio),
            "trend": trend(self.ranges.steps, k3_sums, counts, self.resampled[0], self.resampled[1]),
        }

    def _entry(self, i: int, k3_resampled: np.ndarray) -> dict:
        t = self.totals[:, i]
        n = int(t[C["n"]])
        entry = {"step": int(self.ranges.steps[i]), "n_tokens": n}
        entry["k3_kl"] = float(t[C["k3"]] / n) if n else None
        entry["k3_kl_ci95"] = interval(k3_resampled) if n else None
        entry["extreme_fraction@2"] = float(t[C["extreme"]] / n) if n else None
        entry["abs_logprob_diff_mean"] = float(t[C["abs_delta"]] / n) if n else None
        entry["prob_corr"] = _pearson(t, n)
        if self.num_layers:
            routed = t[C["routed"]]
            entry["router_diff_rate"] = float(t[C["layers"]] / (routed * self.num_layers)) if routed else None
        return entry


def _pearson(t: np.ndarray, n: int) -> float | None:
    """Pearson correlation of p_ref and p_cand over the step's tokens, as probability.py computes it."""
    if not n:
        return None
    s_ref, s_cand = t[C["p_ref"]] / n, t[C["p_cand"]] / n
    var_ref = t[C["p_ref2"]] / n - s_ref**2
    var_cand = t[C["p_cand2"]] / n - s_cand**2
    if var_ref <= 0 or var_cand <= 0:
        return None
    return float((t[C["p_cross"]] / n - s_ref * s_cand) / np.sqrt(var_ref * var_cand))
