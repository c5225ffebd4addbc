"""Where routing differs: the first MoE layer whose expert set differs, per token, and the
routing-flip rate against the router's own margin between its k-th and (k+1)-th selection score.

A flip at a tiny margin is numerics (two experts scored within rounding of each other); a flip at
a large margin points at a bug. Both are streamed chunk by chunk from the frame's differing slots
(`compare_routing`), so nothing here touches the [tokens, layers, k] ids again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.frames.expert_sets import RoutedRows

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

# The first bin, [0, 1e-6), collects ties and margins lost to rounding; the last, [10, 100], also every margin above.
MARGIN_EDGES = np.array([0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0])
INNER_EDGES = MARGIN_EDGES[1:-1].astype(np.float32)  # compared as float32: float32(1e-6) counts as 1e-6


def margin_histogram(margins: np.ndarray) -> np.ndarray:
    """Counts of finite margins per bin (NaN and inf: no margin). One compare-and-count pass per edge:
    several times faster than searchsorted, whose per-value binary search dominates a chunk otherwise."""
    at_least = [np.count_nonzero(np.isfinite(margins))]
    infinite = np.count_nonzero(np.isposinf(margins))
    at_least += [np.count_nonzero(margins >= edge) - infinite for edge in INNER_EDGES]
    at_least.append(0)
    return -np.diff(np.array(at_least, dtype=np.int64))


@dataclass
class RoutingForensics:
    """Per comparison: first differing layer per token, and flips per router-margin bin."""

    num_layers: int
    n_tokens_routed: int = 0
    n_tokens_differing: int = 0
    first_diff_layer: np.ndarray = field(default=None)
    margin_side: str | None = None
    slots: np.ndarray = field(default=None)
    flips: np.ndarray = field(default=None)

    def __post_init__(self):
        self.first_diff_layer = np.zeros(self.num_layers, dtype=np.int64)
        self.slots = np.zeros(len(MARGIN_EDGES) - 1, dtype=np.int64)
        self.flips = np.zeros(len(MARGIN_EDGES) - 1, dtype=np.int64)

    def update(self, frame: PairFrame) -> None:
        """Margins are the candidate's where it has the column, else the reference's."""
        routed, ref_margin, cand_margin = frame.routing, frame.ref.router_margin, frame.cand.router_margin
        token, layer = routed.slot_token, routed.slot_layer
        first = np.ones(len(token), dtype=bool)
        first[1:] = token[1:] != token[:-1]  # slots are in row-major order: a row's first slot is its lowest layer
        self.first_diff_layer += np.bincount(layer[first], minlength=self.num_layers)
        self.n_tokens_differing += int(np.count_nonzero(first))
        self.n_tokens_routed += int(np.count_nonzero(routed.rows))
        side, margin = ("candidate", cand_margin) if cand_margin is not None else ("reference", ref_margin)
        if margin is not None:
            self.margin_side = side
            self._count_margins(routed, *margin)

    def _count_margins(self, routed: RoutedRows, margins: np.ndarray, valid: np.ndarray) -> None:
        rows = routed.rows & valid
        skipped = len(rows) - int(np.count_nonzero(rows))
        if skipped == len(rows):
            return
        if skipped <= len(rows) // 2:  # all rows less the few skipped: no copy of the whole chunk
            self.slots += margin_histogram(margins) - margin_histogram(margins[~rows])
        else:
            self.slots += margin_histogram(margins[rows])
        flipped = rows[routed.slot_token]
        self.flips += margin_histogram(margins[routed.slot_token[flipped], routed.slot_layer[flipped]])

    def merge(self, other: RoutingForensics) -> None:
        for name in ("n_tokens_routed", "n_tokens_differing", "first_diff_layer", "slots", "flips"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.margin_side = self.margin_side or other.margin_side

    def finish(self) -> dict:
        return {"routing_forensics": self.result()}

    def result(self) -> dict | None:
        if self.n_tokens_routed == 0:
            return None
        margin_flip = None
        if self.slots.sum():
            margin_flip = {
                "side": self.margin_side,
                "edges": MARGIN_EDGES.tolist(),
                "slots": self.slots.tolist(),
                "flips": self.flips.tolist(),
            }
        return {
            "first_diff_layer": self.first_diff_layer.tolist(),
            "n_tokens_routed": self.n_tokens_routed,
            "n_tokens_differing": self.n_tokens_differing,
            "margin_flip": margin_flip,
        }
