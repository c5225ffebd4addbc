"""first_token_spike: |delta| on each sample's first response token against the rest of its response.

The first response token's logits come from the inference engine's prefill pass, every later one from
decode (miles #2722): a prefill kernel, chunked prefill or a prefix-cache hit that differs from decode shows
on that token alone. Per sample, the first compared response position and its |delta| are kept (the smallest
position wins on merge, so a sample split over ranges or chunks is counted once); over all compared tokens,
their count, sum of |delta| and of its square. The rest is the total less the first tokens.
"""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.doctor.stats.onset import ONSET_RATIO, ONSET_Z, Z95

# The same margins as position_onset's step (a level 2.5x the other, intervals apart, 6 standard errors);
# at least this many first tokens (one per sample), and position_onset's 64 tokens after them.
SPIKE_MIN_FIRST = 20
SPIKE_MIN_REST = 64


class FirstTokens:
    def __init__(self):
        self.first: dict[int, tuple[int, float]] = {}  # sample -> (its first compared position, |delta| there)
        self.totals = np.zeros(3)  # compared tokens, sum |delta|, sum |delta|^2

    def update(self, frame) -> None:
        idx = frame.compared
        if not len(idx):
            return
        a = frame.abs_delta
        self.totals += (len(a), float(a.sum()), float((a * a).sum()))
        sample, position = frame.rows.sample_id[idx], frame.rows.position[idx]
        # rows are in (sample, position) order: each sample's first row in the chunk is its smallest position
        starts = np.flatnonzero(np.r_[True, sample[1:] != sample[:-1]])
        for s, p, d in zip(sample[starts].tolist(), position[starts].tolist(), a[starts].tolist(), strict=True):
            self._keep(s, p, d)

    def _keep(self, sample: int, position: int, value: float) -> None:
        seen = self.first.get(sample)
        if seen is None or position < seen[0]:
            self.first[sample] = (position, value)

    def merge(self, other: FirstTokens) -> None:
        self.totals += other.totals
        for sample, (position, value) in other.first.items():
            self._keep(sample, position, value)

    def finish(self) -> dict:
        return {"first_abs": np.array([v for _, v in self.first.values()], dtype=np.float64), "totals": self.totals}


def _level(n: float, total: float, squares: float) -> dict:
    mean = total / n
    se = math.sqrt(max(squares / n - mean * mean, 0.0) / n)
    return {"mean_abs_delta": mean, "ci95": [mean - Z95 * se, mean + Z95 * se], "n_tokens": int(n), "se": se}


def find_spike(sums: dict) -> dict | None:
    """The first tokens' level against the rest's, when it is a step up by position_onset's margins."""
    first, (n, total, squares) = sums["first_abs"], sums["totals"]
    rest_n = n - len(first)
    if len(first) < SPIKE_MIN_FIRST or rest_n < SPIKE_MIN_REST:
        return None
    head = _level(len(first), float(first.sum()), float((first * first).sum()))
    rest = _level(rest_n, total - float(first.sum()), max(squares - float((first * first).sum()), 0.0))
    spread = math.sqrt(head["se"] ** 2 + rest["se"] ** 2)
    step = head["mean_abs_delta"] - rest["mean_abs_delta"]
    z = step / spread if spread > 0 else (math.inf if step > 0 else 0.0)
    if step <= 0 or z < ONSET_Z or head["ci95"][0] < ONSET_RATIO * rest["ci95"][1]:
        return None
    ratio = head["mean_abs_delta"] / rest["mean_abs_delta"] if rest["mean_abs_delta"] > 0 else math.inf
    return {"first": head, "rest": rest, "ratio": ratio, "z": z}
