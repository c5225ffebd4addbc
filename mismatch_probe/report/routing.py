"""Routing mismatch (SPEC section 5): expert sets compared as bitmasks, streamed chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.report.sequence_sums import OpenSequences, segment_sums

if TYPE_CHECKING:
    from mismatch_probe.report.pair_frame import PairFrame

SEQUENCE_BINS = 40
PAIR_CHUNK = 1 << 18  # (token, layer) pairs per bitmask pass: bounds the uint64 temporaries


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    table = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
    return table[words.view(np.uint8)].reshape(*words.shape, -1).sum(axis=-1, dtype=np.uint8)


def expert_bit_table(num_experts: int) -> np.ndarray:
    """[num_experts, words] uint64: the one-hot bitmask of each expert id (64 experts per word)."""
    words = max(1, -(-num_experts // 64))
    ids = np.arange(num_experts)
    table = np.zeros((num_experts, words), dtype=np.uint64)
    table[ids, ids // 64] = np.left_shift(np.uint64(1), (ids % 64).astype(np.uint64))
    return table


def expert_set_diff(ref: np.ndarray, cand: np.ndarray, bit_table: np.ndarray) -> np.ndarray:
    """top_k - |S_ref & S_cand| for rows of k expert ids; the order of ids within a row is irrelevant."""
    m, k = ref.shape
    shared = np.zeros(m, dtype=np.int64)
    # One bitmask word at a time, OR-ing the k columns explicitly: a numpy reduce over a short
    # middle axis runs an inner loop per row and is ~20x slower.
    for word in range(bit_table.shape[1]):
        bits = np.ascontiguousarray(bit_table[:, word])
        for start in range(0, m, PAIR_CHUNK):
            r, c = ref[start : start + PAIR_CHUNK], cand[start : start + PAIR_CHUNK]
            a, b = bits[r[:, 0]], bits[c[:, 0]]
            for j in range(1, k):
                a |= bits[r[:, j]]
                b |= bits[c[:, j]]
            shared[start : start + PAIR_CHUNK] += _popcount(a & b)
    return k - shared


def _slot_words(experts: np.ndarray) -> np.ndarray:
    """View each (token, layer) id list as machine words, so equal lists compare in one or a few ops."""
    nbytes = experts.shape[-1] * experts.itemsize
    word = next(w for w in (8, 4, 2, 1) if nbytes % w == 0)
    return np.ascontiguousarray(experts).view(np.dtype(f"u{word}"))


def differing_slots(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """[n, layers] bool: id lists not byte-identical (a superset of the slots whose sets differ)."""
    neq = _slot_words(ref) != _slot_words(cand)
    return neq.reshape(neq.shape[:-1]) if neq.shape[-1] == 1 else neq.any(axis=-1)  # reshape: stays contiguous


@dataclass
class RoutedRows:
    """One chunk's expert-set comparison, as the accumulators read it. Only the few (token, layer) slots
    whose sets differ are listed, in row-major order (ascending row, then layer)."""

    rows: np.ndarray  # [n] bool: routing on both sides, in scope
    slot_token: np.ndarray  # row of each differing slot
    slot_layer: np.ndarray  # its MoE layer
    slot_diff: np.ndarray  # its number of differing experts, top_k - |S_ref & S_cand| (1..top_k)

    @cached_property
    def n_rows(self) -> int:
        return int(np.count_nonzero(self.rows))

    @cached_property
    def alike(self) -> np.ndarray:
        """[n] bool: rows compared and routed to the same expert set in every layer."""
        alike = self.rows.copy()
        alike[self.slot_token] = False
        return alike

    @cached_property
    def layers_differing(self) -> np.ndarray:
        """[n] MoE layers whose expert sets differ, per row."""
        return np.bincount(self.slot_token, minlength=len(self.rows))

    @cached_property
    def experts_differing(self) -> np.ndarray:
        """[n] differing experts summed over layers, per row."""
        return np.bincount(self.slot_token, weights=self.slot_diff, minlength=len(self.rows)).astype(np.int64)


def compare_routing(ref, ref_valid, cand, cand_valid, num_layers: int, bit_table: np.ndarray) -> RoutedRows:
    """ref/cand: [n, layers, k] ids; *_valid: [n] rows to compare (routing present, in scope)."""
    rows = ref_valid & cand_valid
    if not rows.any():
        none = np.zeros(0, dtype=np.int64)
        return RoutedRows(rows=rows, slot_token=none, slot_layer=none, slot_diff=none)
    flat = np.flatnonzero(differing_slots(ref, cand))  # (token, layer) slots whose id lists differ: usually few
    flat = flat[rows[flat // num_layers]]  # masking the few slots, not the [n, layers] table
    k = ref.shape[-1]
    diff = expert_set_diff(ref.reshape(-1, k)[flat], cand.reshape(-1, k)[flat], bit_table)
    differs = diff > 0  # lists in another order hold the same set
    tok, layer = np.divmod(flat[differs], num_layers)
    return RoutedRows(rows=rows, slot_token=tok, slot_layer=layer, slot_diff=diff[differs])


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
