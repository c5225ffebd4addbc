"""Routing mismatch (SPEC section 5): expert sets compared as bitmasks, streamed chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .metrics import ROUTING_KEYS

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


def _add_at(acc: np.ndarray, start: int, values: np.ndarray) -> np.ndarray:
    """acc[start:start+len(values)] += values, growing acc as needed (sample ids are dense from 0)."""
    stop = start + len(values)
    if stop > len(acc):
        acc = np.concatenate([acc, np.zeros(max(stop - len(acc), len(acc)), dtype=acc.dtype)])
    acc[start:stop] += values
    return acc


@dataclass(frozen=True)
class RoutedRows:
    """What one chunk's routing comparison hands to the other accumulators."""

    rows: np.ndarray  # [n] bool: routing on both sides, in scope
    layers_differing: np.ndarray  # [n] MoE layers whose expert sets differ
    slot_token: np.ndarray  # row of each (token, layer) slot whose expert sets differ, ascending
    slot_layer: np.ndarray  # its layer (ascending within a row)


@dataclass
class RoutingAccumulator:
    """Expert-set differences at router (token, layer), token and sequence level."""

    num_layers: int
    top_k: int
    num_experts: int
    n_routing_tokens: int = 0
    router_hist: np.ndarray = field(default=None)
    token_hist: np.ndarray = field(default=None)
    layer_diffs: np.ndarray = field(default=None)
    seq_sum: np.ndarray = field(default=None)  # per sample id: differing experts summed over tokens
    seq_tokens: np.ndarray = field(default=None)  # per sample id: routed tokens compared

    def __post_init__(self):
        self.bit_table = expert_bit_table(self.num_experts)
        self.router_hist = np.zeros(self.top_k + 1, dtype=np.int64)
        self.token_hist = np.zeros(self.num_layers * self.top_k + 1, dtype=np.int64)
        self.layer_diffs = np.zeros(self.num_layers, dtype=np.int64)
        self.seq_sum = np.zeros(1024, dtype=np.int64)
        self.seq_tokens = np.zeros(1024, dtype=np.int64)

    def update(self, sample_id, ref, ref_valid, cand, cand_valid, scope) -> RoutedRows:
        """ref/cand: [n, layers, k] ids; *_valid: [n] routing present; scope: [n] rows to count."""
        rows = ref_valid & cand_valid & scope
        n_rows = int(np.count_nonzero(rows))
        if n_rows == 0:
            none = np.zeros(0, dtype=np.int64)
            return RoutedRows(rows=rows, layers_differing=np.zeros(len(rows), dtype=np.int64), slot_token=none,
                              slot_layer=none)
        flat = np.flatnonzero(differing_slots(ref, cand))  # (token, layer) slots whose id lists differ: usually few
        flat = flat[rows[flat // self.num_layers]]  # masking the few slots, not the [n, layers] table
        tok, layer = np.divmod(flat, self.num_layers)
        k = self.top_k
        diff = expert_set_diff(ref.reshape(-1, k)[flat], cand.reshape(-1, k)[flat], self.bit_table)
        router_hist = np.bincount(diff, minlength=self.top_k + 1)
        router_hist[0] += n_rows * self.num_layers - len(diff)
        self.router_hist += router_hist
        self.layer_diffs += np.bincount(layer[diff > 0], minlength=self.num_layers)
        per_token = np.bincount(tok, weights=diff, minlength=len(rows)).astype(np.int64)[rows]
        self.token_hist += np.bincount(per_token, minlength=len(self.token_hist))
        self.n_routing_tokens += n_rows
        sid = sample_id[rows].astype(np.int64)
        lo = int(sid.min())  # rows are in sample order, so a chunk spans a short range of ids
        self.seq_sum = _add_at(self.seq_sum, lo, np.bincount(sid - lo, weights=per_token).astype(np.int64))
        self.seq_tokens = _add_at(self.seq_tokens, lo, np.bincount(sid - lo))
        differs = diff > 0
        tok, layer = tok[differs], layer[differs]
        return RoutedRows(rows=rows, layers_differing=np.bincount(tok, minlength=len(rows)), slot_token=tok,
                          slot_layer=layer)

    def sequence_means(self) -> np.ndarray:
        has = self.seq_tokens > 0
        return self.seq_sum[has] / self.seq_tokens[has]

    def result(self) -> dict:
        n_tok, n_pairs = self.n_routing_tokens, self.n_routing_tokens * self.num_layers
        if n_tok == 0:
            return {key: None for key in ROUTING_KEYS} | {"n_routing_tokens": 0, "n_routing_sequences": 0}
        weights = np.arange(len(self.router_hist))
        seq_means = self.sequence_means()
        return {
            "router_diff_rate": float(1 - self.router_hist[0] / n_pairs),
            "router_diff_mean": float(self.router_hist @ weights / n_pairs),
            "token_diff_rate": float(1 - self.token_hist[0] / n_tok),
            "token_diff_mean": float(self.token_hist @ np.arange(len(self.token_hist)) / n_tok),
            "seq_router_diff_mean": float(seq_means.mean()),
            "n_routing_tokens": n_tok,
            "n_routing_sequences": int(len(seq_means)),
        }

    def histograms(self) -> dict:
        """Plot data: router and token level counts by number of differing experts; sequence level binned."""
        seq_means = self.sequence_means()
        top = self.num_layers * self.top_k
        # Bin over [0, the smallest power of two covering the data] rather than the full [0, layers*k]:
        # per-sequence means are usually a tiny fraction of layers*k and would all land in bin 0.
        high = float(min(top, 2.0 ** np.ceil(np.log2(max(seq_means.max(initial=0.0), 1e-3))))) or 1.0
        counts, edges = np.histogram(seq_means, bins=SEQUENCE_BINS, range=(0.0, high))
        return {
            "router": self.router_hist.tolist(),
            "token": self.token_hist.tolist(),
            "sequence": {"edges": edges.tolist(), "counts": counts.tolist()},
            "per_layer_router_diff_rate": (self.layer_diffs / self.n_routing_tokens).tolist()
            if self.n_routing_tokens
            else [None] * self.num_layers,
        }
