"""The keys of truncated sampling, for comparisons whose sides record `kept_logmass` (the log of the probability
mass of the top-p/top-k support each response token was scored over; docs/production-rollouts.md).

- `n_outside_support`: response tokens that a side recording kept_logmass scored without a log-prob: the
  sampled token lies outside that side's own support (`probe rescore --sampling rollout`), so its log-prob is
  null there. Such tokens are left out of every other key, as any null log-prob is (PairFrame.use); this count
  says how many. Written where both sides record kept_logmass, or where one does and its manifest declares
  processed log-probs (a vLLM or SGLang rollout, which records no kept mass, against a `--sampling rollout`
  pass). An `hf` rollout writes kept_logmass in raw mode too: against a raw training side, neither key.
- `kept_logmass_diff_mean`: mean over the response tokens where both sides record it of kept_logmass_ref -
  kept_logmass_cand. Processed log-probs are raw ones minus kept_logmass, so delta = raw delta + this
  difference, token by token. Written where both sides record kept_logmass, with its 95% interval: the
  Poisson bootstrap over sequences every other mean uses (bootstrap.py). A mean is linear in per-sequence
  sums, so each chunk's sums are weighted as they come: a sequence cut between chunks gets the same weight
  in both (its weights hash its sample id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.frames.bootstrap import RESAMPLES, ci_key, interval

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

N_OUTSIDE_SUPPORT, KEPT_LOGMASS_DIFF_MEAN = "n_outside_support", "kept_logmass_diff_mean"


@dataclass
class KeptMassAccumulator:
    # (reference, candidate): whether each side's manifest declares processed log-probs (logprobs_mode)
    processed: tuple[bool, bool] = (False, False)
    recorded: list[bool] = field(default_factory=lambda: [False, False])  # each side has the column
    n_outside: int = 0
    totals: np.ndarray = field(default_factory=lambda: np.zeros(2))  # (tokens, sum of the difference)
    resampled: np.ndarray = field(default_factory=lambda: np.zeros((2, RESAMPLES)))

    def update(self, frame: PairFrame) -> None:
        sides = (frame.ref, frame.cand)
        kept = [side.kept_logmass for side in sides]
        if kept == [None, None]:
            return
        response = frame.rows.is_response
        outside = np.zeros(len(response), dtype=bool)
        for i, (side, values) in enumerate(zip(sides, kept)):
            if values is not None:
                self.recorded[i] = True
                outside |= response & values[1] & ~side.logprob_valid
        self.n_outside += int(np.count_nonzero(outside))
        if None in kept:
            return
        (ref, ref_valid), (cand, cand_valid) = kept
        use = response & ref_valid & cand_valid & np.isfinite(ref) & np.isfinite(cand)
        if not use.any():
            return
        diff = ref[use].astype(np.float64) - cand[use].astype(np.float64)
        segment, m = frame.rows.segment[use], len(frame.rows.segment_ids)
        sums = np.stack([np.bincount(segment, minlength=m), np.bincount(segment, weights=diff, minlength=m)])
        self.totals += sums.sum(axis=1)
        self.resampled += sums.astype(np.float64) @ frame.rows.weights

    def merge(self, other: KeptMassAccumulator) -> None:
        self.recorded = [a or b for a, b in zip(self.recorded, other.recorded)]
        self.n_outside += other.n_outside
        self.totals += other.totals
        self.resampled += other.resampled

    def finish(self) -> dict:
        """No key where no side scored over a truncated support: the demo's keys stay as they were."""
        both = all(self.recorded)
        if not (both or any(r and p for r, p in zip(self.recorded, self.processed))):
            return {}
        metrics: dict = {N_OUTSIDE_SUPPORT: self.n_outside}
        if both:
            n, total = self.totals
            point = float(total / n) if n else None
            with np.errstate(divide="ignore", invalid="ignore"):
                resampled = self.resampled[1] / self.resampled[0]
            metrics[KEPT_LOGMASS_DIFF_MEAN] = point
            metrics[ci_key(KEPT_LOGMASS_DIFF_MEAN)] = None if point is None else interval(resampled)
        return {"metrics": metrics}
