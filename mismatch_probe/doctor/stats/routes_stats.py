"""Per side: what its routes look like layer by layer, for routes_constant and routes_invalid.

Out-of-range ids are counted on every row (the aligned pass finds them with one max per chunk). The rest,
how much of a layer's routing lands on its k most used experts and how often a token lists an expert twice,
is counted on rows picked by a hash of (sample, position): every row while the run has at most ROUTE_BUDGET
(token, layer) slots, else one row in a power of two chosen so that about ROUTE_BUDGET slots are checked.
A full pass over [tokens, layers, k] ids costs seconds on a paper-scale run; a fault that these checks name
is in a layer's routes on most tokens, so a sample of rows shows it. The pick is a pure function of the
row, so a report split over ranges picks the same rows, and every sum here is additive.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.rundir.layout import ROLLOUT, Run
from mismatch_probe.rundir.parts import open_part, require_parts

ROUTE_BUDGET = 1 << 20  # (token, layer) slots checked per side: ~0.1 s of numpy on 2 cores


def route_sample_rate(run: Run, num_layers: int) -> int:
    """1 (every row) for runs of at most ROUTE_BUDGET slots, else the power of two that brings them near it."""
    rows = sum(open_part(part).metadata.num_rows for part in require_parts(run.side_dir(ROLLOUT)))  # S3 too
    rate = 1
    while rows * max(num_layers, 1) > ROUTE_BUDGET * rate:
        rate *= 2
    return rate


def picked_rows(sample_id: np.ndarray, position: np.ndarray, rate: int) -> np.ndarray:
    if rate == 1:
        return np.ones(len(sample_id), dtype=bool)
    mixed = (sample_id.astype(np.uint64) * np.uint64(0x9E3779B1) + position.astype(np.uint64)) * np.uint64(2246822519)
    return (mixed >> np.uint64(17)) % np.uint64(rate) == 0


def repeated_ids(x: np.ndarray) -> np.ndarray:
    """[m, layers] bool: slots of [m, layers, k] ids that list some expert twice (k is small: pairs of columns)."""
    k = x.shape[-1]
    out = np.zeros(x.shape[:2], dtype=bool)
    columns = [np.ascontiguousarray(x[..., j]) for j in range(k)]
    for i in range(k):
        for j in range(i + 1, k):
            out |= columns[i] == columns[j]
    return out


class RouteStats:
    """Per MoE layer of one side: rows checked, expert usage (over ids < num_experts), all-zero and
    repeated-id slots, and rows all zeros in every layer, on the picked rows; and, over every row, rows with an id >= num_experts (counted by
    `count_out_of_range` before the frames are built)."""

    def __init__(self, role: str, pair_index: int, num_layers: int, num_experts: int, rate: int):
        self.role, self.pair_index, self.rate = role, pair_index, rate
        self.num_experts = num_experts
        self.rows = 0
        self.usage = np.zeros((num_layers, num_experts + 1), dtype=np.int64)  # last column: out-of-range ids
        self.zero = np.zeros(num_layers, dtype=np.int64)
        self.repeated = np.zeros(num_layers, dtype=np.int64)  # rows listing an id twice, zero-filled rows aside
        self.holes = 0  # rows all zeros in every layer (k > 1): a hole filled with zeros
        self.out_of_range = np.zeros(num_layers, dtype=np.int64)  # every row, not only the picked ones
        self.first_out_of_range: tuple | None = None  # (sample, position, layer, id)

    def update(self, frame) -> None:
        chunk = getattr(frame, self.role)
        if chunk.experts is None:
            return
        pick = chunk.experts_valid & picked_rows(chunk.sample_id, chunk.position, self.rate)
        x = chunk.experts[pick]
        if not len(x):
            return
        m, layers, k = x.shape
        self.rows += m
        ids = np.minimum(x, self.num_experts).astype(np.int64)  # out-of-range ids land in the last column
        offsets = (np.arange(layers, dtype=np.int64) * (self.num_experts + 1))[None, :, None]
        self.usage += np.bincount((ids + offsets).ravel(), minlength=self.usage.size).reshape(self.usage.shape)
        zero = (x == 0).all(axis=-1)  # [m, layers]
        hole = zero.all(axis=1) if k > 1 else np.zeros(m, dtype=bool)  # a row filled with zeros: no route at all
        self.zero += zero.sum(axis=0)
        self.holes += int(np.count_nonzero(hole))
        self.repeated += (repeated_ids(x) & ~hole[:, None]).sum(axis=0)

    def count_out_of_range(self, chunk) -> bool:
        """Rows with an id >= num_experts, per layer, on the raw chunk (the doctor's own pass: `probe report`
        refuses such ids before any accumulator sees them); whether there were any."""
        experts = chunk.experts
        if experts.size == 0 or int(experts.max()) < self.num_experts:
            return False  # the common case: one vectorised max
        bad = (experts >= self.num_experts) & chunk.experts_valid[:, None, None]
        per_row_layer = bad.any(axis=-1)
        self.out_of_range += per_row_layer.sum(axis=0)
        row, layer = (int(v[0]) for v in np.nonzero(per_row_layer))
        example = (int(chunk.sample_id[row]), int(chunk.position[row]), layer, int(experts[row, layer].max()))
        self.first_out_of_range = min(example, self.first_out_of_range or example)
        return True

    def merge(self, other: RouteStats) -> None:
        self.rows += other.rows
        for name in ("usage", "zero", "holes", "repeated", "out_of_range"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.first_out_of_range is not None:
            self.first_out_of_range = min(other.first_out_of_range, self.first_out_of_range or other.first_out_of_range)

    def finish(self, top_k: int) -> dict:
        """Per layer: the share of its ids on its top_k most used experts (1.0 when every token lists the same
        set, or only zeros), all-zero and repeated-id shares of the picked rows, out-of-range rows."""
        rows = max(self.rows, 1)
        top = np.sort(self.usage[:, : self.num_experts], axis=1)[:, -top_k:].sum(axis=1)
        return {
            "rows_checked": self.rows,
            "top_set_share": (top / (rows * top_k)).tolist(),
            "zero_share": (self.zero / rows).tolist(),
            "repeated_rows": self.repeated.tolist(),
            "zero_filled_rows": self.holes,
            "out_of_range_rows": self.out_of_range.tolist(),
            "first_out_of_range": list(self.first_out_of_range) if self.first_out_of_range else None,
        }


class LayerDiffs:
    """Per comparison: (token, layer) slots whose expert sets differ, per MoE layer, from the frame's own
    routing comparison (no extra pass over the ids), and the tokens compared."""

    def __init__(self, num_layers: int):
        self.rows = 0
        self.diffs = np.zeros(num_layers, dtype=np.int64)

    def update(self, frame) -> None:
        if frame.routing is None:
            return
        self.rows += frame.routing.n_rows
        self.diffs += np.bincount(frame.routing.slot_layer, minlength=len(self.diffs))

    def merge(self, other: LayerDiffs) -> None:
        self.rows += other.rows
        self.diffs += other.diffs

    def finish(self) -> dict:
        return {"rows": self.rows, "diffs": self.diffs.tolist()}
