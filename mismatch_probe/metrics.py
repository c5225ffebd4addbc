"""Mismatch metrics (SPEC section 5) as streaming accumulators over aligned numpy chunks.

Each accumulator takes one chunk of aligned rows at a time (`update`) and keeps only sums,
maxima and histograms, so memory is O(chunk) + O(number of sequences) however large the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_THRESHOLDS = (1.5, 2, 5, 10)
SCATTER_BINS = 200
# F(t) is drawn exactly at these t: 100 points per decade over [1, 100], plus the usual thresholds.
CURVE_T = np.union1d(np.logspace(0.0, 2.0, 201), [1.5, 2, 3, 5, 10, 20, 50])
EXTREME_PREFIX = "extreme_fraction@"  # F(T) is stored under extreme_key(T)

PROBABILITY_KEYS = (
    "n_tokens", "k3_kl", "k1_kl", "k2_kl",
    "abs_logprob_diff_mean", "abs_logprob_diff_max", "abs_prob_diff_mean", "abs_prob_diff_max",
)  # fmt: skip
ROUTING_KEYS = (
    "router_diff_rate", "router_diff_mean", "token_diff_rate", "token_diff_mean", "seq_router_diff_mean",
)  # fmt: skip


def threshold_label(t) -> str:
    """The key suffix of `extreme_fraction@T`: T as the user wrote it (2 -> "2", 1.5 -> "1.5")."""
    if isinstance(t, str):
        return t.strip()
    t = float(t)
    return str(int(t)) if t.is_integer() else repr(t)


def extreme_key(t) -> str:
    return f"{EXTREME_PREFIX}{threshold_label(t)}"


def _mean(total: float, n: int) -> float | None:
    return float(total / n) if n else None


# ---- log-probabilities -------------------------------------------------------------------------


@dataclass
class ProbabilityAccumulator:
    """k1/k2/k3 KL, |delta|, |p diff|, F(T), argmax flips and the scatter/F(t) histograms."""

    thresholds: tuple = DEFAULT_THRESHOLDS
    n_response: int = 0
    n_tokens: int = 0
    n_null_ref: int = 0
    n_null_cand: int = 0
    n_nonfinite_ref: int = 0
    n_nonfinite_cand: int = 0
    sum_k1: float = 0.0
    sum_k2: float = 0.0
    sum_k3: float = 0.0
    sum_abs_delta: float = 0.0
    sum_abs_prob: float = 0.0
    max_abs_delta: float = 0.0
    max_abs_prob: float = 0.0
    n_argmax: int = 0
    n_argmax_flips: int = 0
    argmax_seen: bool = False
    extreme_counts: np.ndarray = field(default=None)
    # curve_counts[j] = tokens with |delta| in (log t_{j-1}, log t_j]; index 0 is |delta| <= 0.
    curve_counts: np.ndarray = field(default=None)
    scatter: np.ndarray = field(default=None)

    def __post_init__(self):
        self.log_thresholds = np.log(np.array([float(t) for t in self.thresholds], dtype=np.float64))
        self.extreme_counts = np.zeros(len(self.thresholds), dtype=np.int64)
        self.curve_counts = np.zeros(len(CURVE_T) + 1, dtype=np.int64)
        self.scatter = np.zeros((SCATTER_BINS, SCATTER_BINS), dtype=np.int64)

    def update(self, response, lp_ref, ref_valid, lp_cand, cand_valid, top_ref=None, top_cand=None) -> np.ndarray:
        """`top_*` are (ids, valid) pairs, or None when that side has no top_token_id column.
        Returns the rows compared (response, finite log-probs on both sides)."""
        ok_ref, ok_cand = ref_valid & response, cand_valid & response
        finite_ref, finite_cand = np.isfinite(lp_ref), np.isfinite(lp_cand)
        self.n_response += int(np.count_nonzero(response))
        self.n_null_ref += int(np.count_nonzero(response & ~ref_valid))
        self.n_null_cand += int(np.count_nonzero(response & ~cand_valid))
        self.n_nonfinite_ref += int(np.count_nonzero(ok_ref & ~finite_ref))
        self.n_nonfinite_cand += int(np.count_nonzero(ok_cand & ~finite_cand))
        use = ok_ref & ok_cand & finite_ref & finite_cand
        self._add_tokens(lp_ref[use].astype(np.float64), lp_cand[use].astype(np.float64))
        if top_ref is not None and top_cand is not None:
            self.argmax_seen = True
            both = response & top_ref[1] & top_cand[1]
            self.n_argmax += int(np.count_nonzero(both))
            self.n_argmax_flips += int(np.count_nonzero(both & (top_ref[0] != top_cand[0])))
        return use

    def _add_tokens(self, ref: np.ndarray, cand: np.ndarray) -> None:
        if ref.size == 0:
            return
        delta = cand - ref  # log r
        abs_delta = np.abs(delta)
        self.n_tokens += delta.size
        # expm1 keeps r - 1 - log r accurate when r is within rounding of 1.
        self.sum_k3 += float(np.sum(np.expm1(delta) - delta))
        self.sum_k1 += float(-np.sum(delta))
        # Not np.dot: a BLAS call per chunk wakes its thread pool, which fights the Parquet decoders for the cores.
        self.sum_k2 += float(0.5 * np.sum(delta * delta))
        self.sum_abs_delta += float(abs_delta.sum())
        self.max_abs_delta = max(self.max_abs_delta, float(abs_delta.max()))
        p_ref, p_cand = np.exp(ref), np.exp(cand)
        abs_prob = np.abs(p_cand - p_ref)
        self.sum_abs_prob += float(abs_prob.sum())
        self.max_abs_prob = max(self.max_abs_prob, float(abs_prob.max()))
        ratio_max = np.exp(abs_delta)  # max(r, 1/r)
        for i, t in enumerate(self.thresholds):
            self.extreme_counts[i] += int(np.count_nonzero(ratio_max > float(t)))
        bins = np.searchsorted(np.log(CURVE_T), abs_delta, side="left")
        self.curve_counts += np.bincount(bins, minlength=len(CURVE_T) + 1)
        ix = np.minimum((p_ref * SCATTER_BINS).astype(np.int64), SCATTER_BINS - 1)
        iy = np.minimum((p_cand * SCATTER_BINS).astype(np.int64), SCATTER_BINS - 1)
        self.scatter += np.bincount(ix * SCATTER_BINS + iy, minlength=SCATTER_BINS**2).reshape(SCATTER_BINS, -1)

    def curve(self) -> dict:
        """F(t) at every t of CURVE_T: fraction of tokens with max(r, 1/r) > t."""
        above = self.curve_counts[::-1].cumsum()[::-1][1:]  # above[j] = count(|delta| > log t_j)
        fraction = (above / self.n_tokens).tolist() if self.n_tokens else [None] * len(CURVE_T)
        return {"t": CURVE_T.tolist(), "fraction": fraction}

    def result(self) -> dict:
        n = self.n_tokens
        out = {
            "n_tokens": n,
            "k3_kl": _mean(self.sum_k3, n),
            "k1_kl": _mean(self.sum_k1, n),
            "k2_kl": _mean(self.sum_k2, n),
            "abs_logprob_diff_mean": _mean(self.sum_abs_delta, n),
            "abs_logprob_diff_max": self.max_abs_delta if n else None,
            "abs_prob_diff_mean": _mean(self.sum_abs_prob, n),
            "abs_prob_diff_max": self.max_abs_prob if n else None,
        }
        for t, count in zip(self.thresholds, self.extreme_counts):
            out[extreme_key(t)] = _mean(int(count), n)
        out["argmax_flip_rate"] = _mean(self.n_argmax_flips, self.n_argmax) if self.argmax_seen else None
        out.update(
            n_response_tokens=self.n_response,
            n_skipped=self.n_response - n,
            n_null_ref=self.n_null_ref,
            n_null_cand=self.n_null_cand,
            n_nonfinite_ref=self.n_nonfinite_ref,
            n_nonfinite_cand=self.n_nonfinite_cand,
            n_argmax_compared=self.n_argmax,
        )
        return out
