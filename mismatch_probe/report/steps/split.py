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

from mismatch_probe.frames.bootstrap import RESAMPLES, interval
from mismatch_probe.frames.sequence_sums import segment_sums
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.keys.levels import DEFAULT_MIN_RATIO
from mismatch_probe.report.steps.drift import change_point, drift
from mismatch_probe.report.steps.ranges import StepRanges
from mismatch_probe.report.steps.trend import trend

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

STEP_THRESHOLD = 2.0  # extreme_fraction@2 per step, whatever thresholds the report was asked for
# per-step sums: compared tokens, then the routed rows
COLUMNS = ("n", "k3", "abs_delta", "extreme", "p_ref", "p_cand", "p_ref2", "p_cand2", "p_cross", "routed", "layers")
C = {name: i for i, name in enumerate(COLUMNS)}


@dataclass
class StepSplit:
    ranges: StepRanges
    num_layers: int = 0  # 0: dense, no router_diff_rate
    min_ratio: float = DEFAULT_MIN_RATIO  # a drift's ratio must clear this (or 1/this for a drop)
    totals: np.ndarray = field(default=None)  # [columns, steps]
    resampled: np.ndarray = field(default=None)  # [2, steps, resamples]: weighted k3 sums and token counts

    def __post_init__(self):
        n_steps = len(self.ranges.steps)
        if self.totals is None:
            self.totals = np.zeros((len(COLUMNS), n_steps))
            self.resampled = np.zeros((2, n_steps, RESAMPLES))  # the chunk's shared weights: seed SEED

    def update(self, frame: PairFrame) -> None:
        ids = frame.rows.segment_ids
        if len(ids) == 0:
            return
        step = self.ranges.of(ids)  # per sequence of the chunk; -1: in no recorded step
        kept = np.flatnonzero(step >= 0)
        if len(kept) == 0:
            return
        if frame.compared.size:
            self._add_tokens(frame, step, kept)
        routed = frame.routing
        if routed is not None and routed.rows.any():
            at = step[frame.rows.segment[routed.rows]]
            inside = at >= 0
            n_steps = self.totals.shape[1]
            self.totals[C["routed"]] += np.bincount(at[inside], minlength=n_steps)
            layers = routed.layers_differing[routed.rows][inside]
            self.totals[C["layers"]] += np.bincount(at[inside], weights=layers, minlength=n_steps)

    def _add_tokens(self, frame: PairFrame, step: np.ndarray, kept: np.ndarray) -> None:
        """k3 and the token count per sequence (the bootstrap resamples sequences); the rest per step only."""
        m = len(step)
        per_sequence = np.array([np.bincount(frame.segment, minlength=m), np.zeros(m)])
        per_sequence[1] = segment_sums(frame.k3[None, :], frame.segment, m)[0]
        steps, at = np.unique(step[kept], return_inverse=True)
        onehot = (at[None, :] == np.arange(len(steps))[:, None]).astype(np.float64)  # [steps in chunk, sequences]
        counts, k3 = per_sequence[:, kept]
        self.totals[C["n"], steps] += onehot @ counts
        self.totals[C["k3"], steps] += onehot @ k3
        weights = frame.rows.weights[kept]  # [sequences, resamples], shared by every comparison of the chunk
        self.resampled[0, steps] += onehot @ (k3[:, None] * weights)
        self.resampled[1, steps] += onehot @ (counts[:, None] * weights)
        # The rest per run of consecutive sequences of one step: their tokens are one contiguous slice (rows
        # are in sample-id order), summed through views; a chunk holds a run or two.
        change = np.flatnonzero(np.diff(step)) + 1
        firsts = np.r_[0, change]
        bounds = np.searchsorted(frame.segment, np.r_[firsts, m])
        p = np.stack([frame.p_ref, frame.p_cand])
        for first, lo, hi in zip(firsts, bounds[:-1], bounds[1:]):
            if step[first] < 0 or hi == lo:
                continue
            part = p[:, lo:hi]
            moments = np.einsum("ij,kj->ik", part, part)  # no BLAS: its threads cost more than they save here
            self.totals[C["abs_delta"] : C["routed"], step[first]] += np.r_[
                frame.abs_delta[lo:hi].sum(),
                np.count_nonzero(frame.ratio_max[lo:hi] > STEP_THRESHOLD),
                part.sum(axis=1),
                moments[0, 0],
                moments[1, 1],
                moments[0, 1],
            ]

    def merge(self, other: StepSplit) -> None:
        self.totals += other.totals
        self.resampled += other.resampled

    def finish(self) -> dict:
        with np.errstate(divide="ignore", invalid="ignore"):
            k3 = self.resampled[0] / self.resampled[1]  # [steps, resamples]
        entries = [self._entry(i, k3[i]) for i in range(len(self.ranges.steps))]
        k3_sums, counts = self.totals[C["k3"]], self.totals[C["n"]]
        candidate = change_point(self.ranges.steps, k3_sums, counts, self.resampled[0], self.resampled[1])
        return {
            "steps": entries,
            "drift": drift(candidate, self.min_ratio),
            "change_point": candidate,  # the best split even when not named: --max-drift judges it
            "trend": trend(self.ranges.steps, k3_sums, counts, self.resampled[0], self.resampled[1]),
        }

    def _entry(self, i: int, k3_resampled: np.ndarray) -> dict:
        t = self.totals[:, i]
        n = int(t[C["n"]])
        entry = {"step": int(self.ranges.steps[i]), "n_tokens": n}
        entry["k3_kl"] = float(t[C["k3"]] / n) if n else None
        entry["k3_kl_ci95"] = interval(k3_resampled) if n else None
        entry[EXTREME_FRACTION.at(STEP_THRESHOLD)] = float(t[C["extreme"]] / n) if n else None
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
