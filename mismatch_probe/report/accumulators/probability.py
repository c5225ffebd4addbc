"""The accumulator of the per-token mismatch metrics without an interval (their keys: report/keys/; the
thresholds of F(T): report/keys/levels.py).

Each accumulator takes one chunk of aligned rows at a time (`update`) and keeps only sums,
maxima and histograms, so memory is O(chunk) + O(number of sequences) however large the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

SCATTER_BINS = 200
# F(t) is drawn exactly at these t: 100 points per decade over [1, 100], plus the usual thresholds.
CURVE_T = np.union1d(np.logspace(0.0, 2.0, 201), [1.5, 2, 3, 5, 10, 20, 50])


def _mean(total: float, n: int) -> float | None:
    return float(total / n) if n else None


# ---- log-probabilities -------------------------------------------------------------------------


@dataclass
class ProbabilityAccumulator:
    """Response tokens compared and left out, max |delta|, |p diff|, argmax flips, the F(t) curve and the
    p_ref/p_cand scatter. The k-estimators and F(T) carry intervals, so they are SequenceStats'."""

    n_response: int = 0
    n_tokens: int = 0
    n_null_ref: int = 0
    n_null_cand: int = 0
    n_nonfinite_ref: int = 0
    n_nonfinite_cand: int = 0
    sum_abs_prob: float = 0.0
    max_abs_delta: float = 0.0
    max_abs_prob: float = 0.0
    # sums over tokens of p_ref, p_cand, their squares and product, p_cand - p_ref and its square: the
    # spread of the probability differences and the correlation of the two sides' token probabilities
    prob_moments: np.ndarray = field(default=None)
    n_bit_compared: int = 0  # response tokens with a log-prob (finite or not) on both sides
    n_bit_mismatch: int = 0  # of those, float32 values that differ (+0 == -0; NaN differs from everything)
    n_argmax: int = 0
    n_argmax_flips: int = 0
    argmax_seen: bool = False
    # curve_counts[j] = tokens with max(r, 1/r) in (t_{j-1}, t_j]; index 0 is max(r, 1/r) <= 1.
    curve_counts: np.ndarray = field(default=None)
    scatter: np.ndarray = field(default=None)

    def __post_init__(self):
        self.curve_counts = np.zeros(len(CURVE_T) + 1, dtype=np.int64)
        self.scatter = np.zeros((SCATTER_BINS, SCATTER_BINS), dtype=np.int64)
        self.prob_moments = np.zeros(7)

    def update(self, frame: PairFrame) -> None:
        response = frame.rows.is_response
        self.n_response += int(np.count_nonzero(response))
        self.n_null_ref += int(np.count_nonzero(response & ~frame.ref.logprob_valid))
        self.n_null_cand += int(np.count_nonzero(response & ~frame.cand.logprob_valid))
        self.n_nonfinite_ref += int(np.count_nonzero(frame.ref_ok & ~frame.finite_ref))
        self.n_nonfinite_cand += int(np.count_nonzero(frame.cand_ok & ~frame.finite_cand))
        both = frame.ref_ok & frame.cand_ok
        self.n_bit_compared += int(np.count_nonzero(both))
        self.n_bit_mismatch += int(np.count_nonzero(both & (frame.ref.logprob != frame.cand.logprob)))
        if frame.compared.size:
            self._add_tokens(frame)
        top_ref, top_cand = frame.ref.top, frame.cand.top  # (ids, valid), or None without a top_token_id column
        if top_ref is not None and top_cand is not None:
            self.argmax_seen = True
            both = response & top_ref[1] & top_cand[1]
            self.n_argmax += int(np.count_nonzero(both))
            self.n_argmax_flips += int(np.count_nonzero(both & (top_ref[0] != top_cand[0])))

    def _add_tokens(self, frame: PairFrame) -> None:
        self.n_tokens += frame.compared.size
        self.max_abs_delta = max(self.max_abs_delta, float(frame.abs_delta.max()))
        p_ref, p_cand = frame.p_ref, frame.p_cand
        abs_prob = np.abs(p_cand - p_ref)
        self.sum_abs_prob += float(abs_prob.sum())
        self.max_abs_prob = max(self.max_abs_prob, float(abs_prob.max()))
        diff = p_cand - p_ref
        # one reduction over a stacked array: a BLAS dot per product costs far more on a busy machine
        products = np.stack([p_ref, p_cand, p_ref * p_ref, p_cand * p_cand, p_ref * p_cand, diff, diff * diff])
        self.prob_moments += products.sum(axis=1)
        # The comparison extreme_fraction@T makes (max(r, 1/r) > T), so F(t) at a threshold is that key.
        bins = np.searchsorted(CURVE_T, frame.ratio_max, side="left")
        self.curve_counts += np.bincount(bins, minlength=len(CURVE_T) + 1)
        ix = np.minimum((p_ref * SCATTER_BINS).astype(np.int64), SCATTER_BINS - 1)
        iy = np.minimum((p_cand * SCATTER_BINS).astype(np.int64), SCATTER_BINS - 1)
        self.scatter += np.bincount(ix * SCATTER_BINS + iy, minlength=SCATTER_BINS**2).reshape(SCATTER_BINS, -1)

    def merge(self, other: ProbabilityAccumulator) -> None:
        for name in (
            "n_response",
            "n_tokens",
            "n_null_ref",
            "n_null_cand",
            "n_nonfinite_ref",
            "n_nonfinite_cand",
            "sum_abs_prob",
            "prob_moments",
            "n_argmax",
            "n_argmax_flips",
            "n_bit_compared",
            "n_bit_mismatch",
            "curve_counts",
            "scatter",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_abs_delta = max(self.max_abs_delta, other.max_abs_delta)
        self.max_abs_prob = max(self.max_abs_prob, other.max_abs_prob)
        self.argmax_seen = self.argmax_seen or other.argmax_seen

    def _prob_spread(self) -> dict:
        """Population std of p_cand - p_ref and Pearson correlation of p_ref with p_cand, over tokens."""
        n = self.n_tokens
        if not n:
            return {"abs_prob_diff_std": None, "prob_diff_std": None, "prob_corr": None}
        s_ref, s_cand, ss_ref, ss_cand, s_cross, s_diff, ss_diff = self.prob_moments / n
        var_ref, var_cand = ss_ref - s_ref**2, ss_cand - s_cand**2
        corr = (s_cross - s_ref * s_cand) / np.sqrt(var_ref * var_cand) if var_ref > 0 and var_cand > 0 else None
        s_abs = self.sum_abs_prob / n  # |d|^2 = d^2: verl's torch.std of |p_cand - p_ref|, n - 1 in the denominator
        abs_var = (ss_diff - s_abs**2) * n / (n - 1) if n > 1 else None
        return {
            "abs_prob_diff_std": None if abs_var is None else float(np.sqrt(max(abs_var, 0.0))),
            "prob_diff_std": float(np.sqrt(max(ss_diff - s_diff**2, 0.0))),
            "prob_corr": None if corr is None else float(corr),
        }

    def curve(self) -> dict:
        """F(t) at every t of CURVE_T: fraction of tokens with max(r, 1/r) > t."""
        above = self.curve_counts[::-1].cumsum()[::-1][1:]  # above[j] = count(max(r, 1/r) > t_j)
        fraction = (above / self.n_tokens).tolist() if self.n_tokens else [None] * len(CURVE_T)
        return {"t": CURVE_T.tolist(), "fraction": fraction}

    def finish(self) -> dict:
        n = self.n_tokens
        metrics = {
            "n_tokens": n,
            "abs_logprob_diff_max": self.max_abs_delta if n else None,
            "abs_prob_diff_mean": _mean(self.sum_abs_prob, n),
            "abs_prob_diff_max": self.max_abs_prob if n else None,
            **self._prob_spread(),
            "argmax_flip_rate": _mean(self.n_argmax_flips, self.n_argmax) if self.argmax_seen else None,
            "logprob_bit_mismatch_fraction": _mean(self.n_bit_mismatch, self.n_bit_compared),
            "logprob_bit_mismatch_count": self.n_bit_mismatch,
            "n_response_tokens": self.n_response,
            "n_skipped": self.n_response - n,
            "n_null_ref": self.n_null_ref,
            "n_null_cand": self.n_null_cand,
            "n_nonfinite_ref": self.n_nonfinite_ref,
            "n_nonfinite_cand": self.n_nonfinite_cand,
            "n_argmax_compared": self.n_argmax,
        }
        return {"metrics": metrics, "extreme_fraction_curve": self.curve()}
