"""Routing mismatch (SPEC section 5): expert-set differences streamed chunk by chunk into histograms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.frames.sequence_sums import OpenSequences, segment_sums

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

SEQUENCE_BINS = 40


@dataclass
class RoutingAccumulator:
    """Expert-set differences at router (token, layer), token and sequence level. The differing-slot rates
    with their intervals are SequenceStats' (router_diff_rate, token_diff_rate)."""

    num_layers: int
    top_k: int
    n_routing_tokens: int = 0
    router_hist: np.ndarray = field(default=None)
    token_hist: np.ndarray = field(default=None)
    layer_diffs: np.ndarray = field(default=None)
    sequences: OpenSequences = field(default_factory=OpenSequences)
    # [3, k] blocks of complete sequences with routed tokens: sample id (exact in float64), differing experts
    # summed over tokens, routed tokens
    done: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self):
        self.router_hist = np.zeros(self.top_k + 1, dtype=np.int64)
        self.token_hist = np.zeros(self.num_layers * self.top_k + 1, dtype=np.int64)
        self.layer_diffs = np.zeros(self.num_layers, dtype=np.int64)

    def update(self, frame: PairFrame) -> None:
        routed = frame.routing
        if routed.n_rows == 0:
            return
        router_hist = np.bincount(routed.slot_diff, minlength=self.top_k + 1)
        router_hist[0] += routed.n_rows * self.num_layers - len(routed.slot_diff)
        self.router_hist += router_hist
        self.layer_diffs += np.bincount(routed.slot_layer, minlength=self.num_layers)
        per_token = routed.experts_differing[routed.rows]
        self.token_hist += np.bincount(per_token, minlength=len(self.token_hist))
        self.n_routing_tokens += routed.n_rows
        at, m = frame.rows.segment[routed.rows], len(frame.rows.segment_ids)
        sums = np.vstack([segment_sums(per_token[None].astype(np.float64), at, m), np.bincount(at, minlength=m)])
        self._keep(*self.sequences.add(frame.rows.segment_ids, sums))

    def _keep(self, ids: np.ndarray, sums: np.ndarray) -> None:
        routed = sums[1] > 0
        if routed.any():
            self.done.append(np.vstack([ids[routed], sums[:, routed]]))

    def merge(self, other: RoutingAccumulator) -> None:
        self.n_routing_tokens += other.n_routing_tokens
        for mine, theirs in (
            (self.router_hist, other.router_hist),
            (self.token_hist, other.token_hist),
            (self.layer_diffs, other.layer_diffs),
        ):
            mine += theirs
        self.sequences.merge(other.sequences)
        self.done += other.done

    def sequence_means(self) -> np.ndarray:
        """Each routed sequence's mean differing experts per token, in sample-id order."""
        self._keep(*self.sequences.close(2))
        done = np.hstack(self.done) if self.done else np.zeros((3, 0))
        self.done = [done]
        _, total, tokens = done[:, np.argsort(done[0], kind="stable")]  # the same order however ranges merged
        return total / tokens

    def finish(self) -> dict:
        n_tok, n_pairs = self.n_routing_tokens, self.n_routing_tokens * self.num_layers
        if n_tok == 0:
            metrics = dict.fromkeys(("router_diff_mean", "token_diff_mean", "seq_router_diff_mean"))
            return {"metrics": metrics | {"n_routing_tokens": 0, "n_routing_sequences": 0}, "routing_histograms": None}
        seq_means = self.sequence_means()
        metrics = {
            "router_diff_mean": float(self.router_hist @ np.arange(len(self.router_hist)) / n_pairs),
            "token_diff_mean": float(self.token_hist @ np.arange(len(self.token_hist)) / n_tok),
            "seq_router_diff_mean": float(seq_means.mean()),
            "n_routing_tokens": n_tok,
            "n_routing_sequences": int(len(seq_means)),
        }
        return {"metrics": metrics, "routing_histograms": self.histograms(seq_means)}

    def histograms(self, seq_means: np.ndarray) -> dict:
        """Plot data: router and token level counts by number of differing experts; sequence level binned."""
        top = self.num_layers * self.top_k
        # Bin over [0, the smallest power of two covering the data] rather than the full [0, layers*k]:
        # per-sequence means are usually a tiny fraction of layers*k and would all land in bin 0.
        high = float(min(top, 2.0 ** np.ceil(np.log2(max(seq_means.max(initial=0.0), 1e-3))))) or 1.0
        counts, edges = np.histogram(seq_means, bins=SEQUENCE_BINS, range=(0.0, high))
        return {
            "router": self.router_hist.tolist(),
            "token": self.token_hist.tolist(),
            "sequence": {"edges": edges.tolist(), "counts": counts.tolist()},
            "per_layer_router_diff_rate": (self.layer_diffs / self.n_routing_tokens).tolist(),
        }
