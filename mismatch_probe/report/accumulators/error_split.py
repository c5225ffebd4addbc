"""Each side's numerical error against an fp32 score set F, from one streaming pass over three sides.

Over response tokens with finite log-probs on all three sides, e_ref = ref - F and e_cand = cand - F,
so delta = e_cand - e_ref and var(delta) = var(e_ref) + var(e_cand) - 2 cov(e_ref, e_cand).
Chunks, and the accumulators of other row ranges, are merged with the pairwise (Chan et al.) update of
means and centred co-moments: plain sums of squares would cancel catastrophically when an error has a
large mean and a tiny spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame


@dataclass
class ErrorSplitAccumulator:
    fp32_side: str
    n: int = 0
    mean: np.ndarray = field(default_factory=lambda: np.zeros(2))  # (e_ref, e_cand)
    comoment: np.ndarray = field(default_factory=lambda: np.zeros((2, 2)))  # centred sums of products

    def update(self, frame: PairFrame) -> None:
        """Over the frame's compared rows where the fp32 side has a finite log-prob too."""
        fp32 = frame.fp32
        use = frame.use & fp32.logprob_valid & np.isfinite(fp32.logprob)
        m = int(np.count_nonzero(use))
        if m == 0:
            return
        base = fp32.logprob[use].astype(np.float64)
        e_ref, e_cand = frame.ref.logprob[use] - base, frame.cand.logprob[use] - base
        chunk_mean = np.array([e_ref.mean(), e_cand.mean()])
        e_ref -= chunk_mean[0]
        e_cand -= chunk_mean[1]
        # Sums of products, not a matrix product: a BLAS call per chunk wakes its thread pool, which
        # fights the Parquet decoders for the cores.
        cross = float(np.sum(e_ref * e_cand))
        chunk_comoment = np.array([[np.sum(e_ref * e_ref), cross], [cross, np.sum(e_cand * e_cand)]])
        self._combine(m, chunk_mean, chunk_comoment)

    def merge(self, other: ErrorSplitAccumulator) -> None:
        if other.n:
            self._combine(other.n, other.mean, other.comoment)

    def _combine(self, m: int, mean: np.ndarray, comoment: np.ndarray) -> None:
        """Chan et al.'s pairwise update: these n rows and m more, of the given mean and centred co-moments."""
        total = self.n + m
        shift = mean - self.mean
        self.comoment = self.comoment + (comoment + np.outer(shift, shift) * (self.n * m / total))
        self.mean = self.mean + shift * (m / total)
        self.n = total

    def finish(self) -> dict:
        """Nothing in the comparison's JSON: the run's attribution reads `result()`."""
        return {}

    def result(self) -> dict:
        """Population (co)variances of the two errors, var(delta), and each part's share of var(delta)."""
        if self.n == 0:
            keys = (
                "var_delta",
                "var_ref",
                "var_cand",
                "cov",
                "correlation",
                "share_ref",
                "share_cand",
                "share_cov",
                "mean_error_ref",
                "mean_error_cand",
            )
            return {"n_tokens": 0} | dict.fromkeys(keys)
        (var_ref, cov), (_, var_cand) = (self.comoment / self.n).tolist()
        var_delta = var_ref + var_cand - 2.0 * cov
        share = (lambda part: part / var_delta) if var_delta > 0 else (lambda part: None)
        spread = (var_ref * var_cand) ** 0.5
        return {
            "n_tokens": self.n,
            "var_delta": var_delta,
            "var_ref": var_ref,
            "var_cand": var_cand,
            "cov": cov,
            "correlation": cov / spread if spread > 0 else None,
            "share_ref": share(var_ref),
            "share_cand": share(var_cand),
            "share_cov": share(-2.0 * cov),
            "mean_error_ref": float(self.mean[0]),
            "mean_error_cand": float(self.mean[1]),
        }
