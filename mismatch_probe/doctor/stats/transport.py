"""cumulative_logprobs: one side's log-probs mangled in transport, in either of the two ways reported.

Running sums (dynamo PR #13879): a cumulative side's row p+1 minus its row p is the other side's row p+1.
`PairStats` sums that fit over consecutive pairs (exactly mergeable through `Pairwise`).

Chunk totals spread evenly (dynamo PR #13996, SGLang#39260): the side is flat over each stream chunk, at the
chunk's mean. Its chunks are its runs of equal consecutive values; spread from the chunk's total, each value
is the run's mean of the other side's up to the ordinary mismatch, so the fit error of a run,
|sum over the run of delta|, is small where the per-token |delta| is not. `RunFit` sums both over runs of
compared response tokens. A run may straddle chunks and ranges: each range keeps its first and last run
open (rows kept) and closes them when the neighbouring range is merged in, or at the end of the run, so a
split report counts the same runs as one pass.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.doctor.stats.pairwise import Rows, first_key, join_rows, take_rows

# A fit that is 5 times closer than the stored values, on a comparison whose mean |delta| is at least 0.05
# nats: clean comparisons sit near 0.01 and fit no better (runs of equal values are rare and short); the
# plants fit 10-1000 times better.
TRANSPORT_FACTOR = 5.0
TRANSPORT_FLOOR = 0.05
FLAT_SHARE = 0.3  # tokens in runs of two or more, for chunk totals: clean runs have a few percent
TOTALS = ("fit", "stored", "tokens", "flat_tokens", "flat_runs")


def run_starts(rows: Rows) -> np.ndarray:
    """Index of each run's first row: a run is consecutive positions of one sample with equal values."""
    s, p, v = rows["sample_id"], rows["position"], rows["value"]
    joined = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + 1) & (v[1:] == v[:-1])
    return np.flatnonzero(np.r_[True, ~joined])


def tally(rows: Rows | None) -> dict[str, float]:
    """The totals of complete runs."""
    out = dict.fromkeys(TOTALS, 0.0)
    if rows is None or not len(rows["sample_id"]):
        return out
    starts = run_starts(rows)
    delta = rows["delta"]
    sums = np.add.reduceat(delta, starts)
    lengths = np.diff(np.r_[starts, len(delta)])
    flat = lengths >= 2
    out["fit"] = float(np.abs(sums).sum())
    out["stored"] = float(np.abs(delta).sum())
    out["tokens"] = float(len(delta))
    out["flat_tokens"] = float(lengths[flat].sum())
    out["flat_runs"] = float(np.count_nonzero(flat))
    return out


def _slice(rows: Rows, start: int, stop: int | None = None) -> Rows:
    return take_rows(rows, slice(start, stop))


class RunFit:
    """Over one comparison, with one side (`role`) as the one that may be flat over stream chunks."""

    def __init__(self, role: str):
        self.role = role
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.head: Rows | None = None  # the range's first run, once the range holds a second one
        self.tail: Rows | None = None  # the range's last run (the only one while head is None)

    def _add(self, rows: Rows | None) -> None:
        for key, value in tally(rows).items():
            self.totals[key] += value

    def update(self, frame) -> None:
        idx = frame.compared
        if not len(idx):
            return
        side = getattr(frame, self.role)
        sign = 1.0 if self.role == "cand" else -1.0  # delta is candidate - reference: make it flat - other
        rows = {
            "sample_id": frame.rows.sample_id[idx],
            "position": frame.rows.position[idx],
            "value": side.logprob[idx],
            "delta": sign * frame.delta,
        }
        data = rows if self.tail is None else join_rows(self.tail, rows)
        starts = run_starts(data)
        if len(starts) == 1:
            self.tail = data
            return
        first, middle = _slice(data, 0, starts[1]), _slice(data, starts[1], starts[-1])
        if self.head is None:
            self.head = first
        else:
            self._add(first)
        self._add(middle)
        self.tail = _slice(data, starts[-1])

    def merge(self, other: RunFit) -> None:
        for key, value in other.totals.items():
            self.totals[key] += value
        if other.tail is None:
            return
        if self.tail is None:
            self.head, self.tail = other.head, other.tail
            return
        early, late = (
            (self, other) if first_key(self.head or self.tail) < first_key(other.head or other.tail) else (other, self)
        )
        joined = join_rows(early.tail, late.head if late.head is not None else late.tail)
        starts = run_starts(joined)
        first, second = (
            (joined, None) if len(starts) == 1 else (_slice(joined, 0, starts[1]), _slice(joined, starts[1]))
        )
        head, tail = early.head, late.tail if late.head is not None else None
        if second is None:  # the two ranges' runs at the seam are one run
            if head is None:
                head = first if tail is not None else None
            elif tail is not None:
                self._add(first)
            tail = tail if tail is not None else first
        else:
            if head is None:
                head = first
            else:
                self._add(first)
            if tail is None:
                tail = second
            else:
                self._add(second)
        self.head, self.tail = head, tail

    def finish(self) -> dict:
        out = dict(self.totals)
        for rows in (self.head, self.tail):
            for key, value in tally(rows).items():
                out[key] += value
        return out


def cumulative_fit(s: dict, role: str) -> tuple[float, float, int] | None:
    """(mean fit error as running sums, mean stored |delta|, pairs) of one side from PairStats sums."""
    n = int(s.get("n_cum", 0))
    if not n:
        return None
    return s[f"cum_{role}"] / n, s["cum_stored"] / n, n
