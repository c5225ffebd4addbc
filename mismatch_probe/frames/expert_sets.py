"""Expert sets compared as bitmasks: which (token, layer) routes of two sides differ, and by how many experts.

The report's routing accumulators and the doctor's pair checks both read these primitives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

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
