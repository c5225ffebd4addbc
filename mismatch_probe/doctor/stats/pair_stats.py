"""Per comparison: the sums every doctor check on a pair of sides reads, streamed like the report.

All sums are additive, so two ranges merge exactly (floats up to the order of addition); shifted pairs that
straddle a boundary are paired by `Pairwise`. Routing shifts are checked on one (token) pair in
ROUTE_SAMPLE, chosen by a hash of (sample, position): a pure function of the row, so a split report picks
the same pairs, and the routing arithmetic stays a small fraction of the report's.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mismatch_probe.doctor.stats.pairwise import Pairwise, Rows, same_sample
from mismatch_probe.frames.expert_sets import differing_slots, expert_bit_table, expert_set_diff

ROUTE_SAMPLE = 8


def _picked(sample_id: np.ndarray, position: np.ndarray) -> np.ndarray:
    mixed = (sample_id.astype(np.uint64) * np.uint64(2654435761) + position.astype(np.uint64)) * np.uint64(40503)
    return (mixed >> np.uint64(13)) % np.uint64(ROUTE_SAMPLE) == 0


def _routed_alike(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[m] bool: rows of [m, layers, top_k] expert ids that hold the same expert set as `y` in every layer,
    whatever the order of ids within a set. Byte-identical slots settle most; the rest are compared as
    bitmask sets (the report's own routing comparison) in two rounds: first each token's first non-identical
    slot, which settles nearly every token of a shifted comparison, then every such slot of the tokens
    still alike."""
    differs = differing_slots(x, y)  # [m, layers]
    suspects = np.flatnonzero(differs.any(axis=1))
    alike = np.ones(len(x), dtype=bool)
    if not len(suspects):
        return alike
    bits = expert_bit_table(int(max(x.max(), y.max())) + 1)
    first = differs[suspects].argmax(axis=1)
    apart = expert_set_diff(x[suspects, first], y[suspects, first], bits) > 0
    alike[suspects[apart]] = False
    rest = suspects[~apart]  # reordered in their first slot: look at all their slots
    token, layer = np.nonzero(differs[rest])
    if len(token):
        slot_apart = expert_set_diff(x[rest[token], layer], y[rest[token], layer], bits) > 0
        alike[rest[token[slot_apart]]] = False
    return alike


def _tokens_routed_alike(x: np.ndarray, y: np.ndarray) -> int:
    """How many rows of x hold the same expert sets as y's in every layer (see `_routed_alike`)."""
    return int(np.count_nonzero(_routed_alike(x, y)))


def _pairs_routed_alike(x: np.ndarray, i: np.ndarray, y: np.ndarray, j: np.ndarray) -> int:
    """`_tokens_routed_alike(x[i], y[j])` without copying every pair's rows: for a shifted comparison nearly
    every pair differs in its first layer already, so only the pairs alike there are gathered whole."""
    if not len(i):
        return 0
    first = differing_slots(x[i, :1], y[j, :1])[:, 0]
    suspects = np.flatnonzero(first)
    if len(suspects):
        a, b = x[i[suspects], 0], y[j[suspects], 0]
        first[suspects] = expert_set_diff(a, b, expert_bit_table(int(max(a.max(), b.max())) + 1)) > 0
    alike = np.flatnonzero(~first)  # the same set in the first layer: look at every layer
    return _tokens_routed_alike(x[i[alike]], y[j[alike]]) if len(alike) else 0


def _picked_rows_routed_alike(frame, picked: np.ndarray) -> np.ndarray:
    """[n] bool: picked rows (`_picked`) routed on both sides to the same expert set in every layer; only
    picked rows start a routing pair, so the others are left False. The frame's own comparison settles the
    rows in its routing scope; picked rows outside it (prompt rows of a response-scoped report) are compared
    here."""
    routed = frame.ref.experts_valid & frame.cand.experts_valid
    alike = frame.routing.alike & picked
    outside = np.flatnonzero(routed & ~frame.routing.rows & picked)
    if len(outside):
        alike[outside] = _routed_alike(frame.ref.experts[outside], frame.cand.experts[outside])
    return alike


class PairStats(Pairwise):
    def __init__(self):
        super().__init__()
        self.s: dict[str, float] = defaultdict(float)

    # ---- per row, from the frame's compared tokens -----------------------------------------------
    def update(self, frame) -> None:
        self._tokens(frame)
        self._temperature(frame)
        self._routing_same(frame)
        super().update(frame)

    def _tokens(self, frame) -> None:
        s, delta = self.s, frame.delta
        s["n"] += len(delta)
        s["abs"] += float(frame.abs_delta.sum())
        s["delta"] += float(delta.sum())
        s["n_ref_above"] += int(np.count_nonzero(delta < 0))  # delta = cand - ref (truncated_logprobs)
        s["n_equal"] += int(np.count_nonzero(delta == 0))
        s["k3"] += float(frame.k3.sum())

    def _temperature(self, frame) -> None:
        """The gap between the top-1 and the sampled token's log-prob on each side is (z_top - z_tok) / T:
        its ratio between the sides is the ratio of their temperatures, whatever the logits. And a side at
        the sampling temperature is calibrated: its mean top-1 probability is the rate at which the
        sampled token is its top-1."""
        ref, cand, idx = frame.ref, frame.cand, frame.compared
        if ref.top is None or cand.top is None or ref.top_logprob is None or cand.top_logprob is None:
            return
        token = frame.rows.token_id[idx]
        tops = []
        for name, side, lp in (("ref", ref, frame.lp_ref), ("cand", cand, frame.lp_cand)):
            ids, valid = side.top[0][idx], side.top[1][idx] & side.top_logprob[1][idx]
            top_lp = side.top_logprob[0][idx].astype(np.float64)
            p = np.exp(top_lp[valid])
            self.s[f"cal_n_{name}"] += len(p)
            self.s[f"cal_p_{name}"] += float(p.sum())
            self.s[f"cal_var_{name}"] += float((p * (1 - p)).sum())
            self.s[f"cal_hit_{name}"] += int(np.count_nonzero(ids[valid] == token[valid]))
            tops.append((ids, valid, top_lp - lp))
        (ids_r, ok_r, gap_r), (ids_c, ok_c, gap_c) = tops
        gap = ok_r & ok_c & (ids_r == ids_c) & (ids_r != token) & (gap_r > 0) & (gap_c > 0)
        self.s["n_gap"] += int(np.count_nonzero(gap))
        self.s["gap_ref"] += float(gap_r[gap].sum())
        self.s["gap_cand"] += float(gap_c[gap].sum())

    def _routing_same(self, frame) -> None:
        """k3 over the tokens whose routing is identical in every layer: what routing cannot explain."""
        if frame.routing is None:
            return
        picked = frame.routing.alike[frame.compared]
        self.s["n_same"] += int(np.count_nonzero(picked))
        self.s["k3_same"] += float(frame.k3[picked].sum())

    # ---- pairs of consecutive rows -------------------------------------------------------------------
    def payload(self, frame) -> Rows:
        rows = {
            "sample_id": frame.rows.sample_id,
            "position": frame.rows.position,
            "ok_ref": frame.ref_ok & frame.finite_ref,
            "ok_cand": frame.cand_ok & frame.finite_cand,
            "lp_ref": frame.ref.logprob,
            "lp_cand": frame.cand.logprob,
        }
        if frame.ref.experts is not None and frame.cand.experts is not None:
            picked = _picked(frame.rows.sample_id, frame.rows.position)
            rows |= {
                "ex_ref": frame.ref.experts,
                "ex_cand": frame.cand.experts,
                "rv_ref": frame.ref.experts_valid,
                "rv_cand": frame.cand.experts_valid,
                "picked": picked,
                "alike": _picked_rows_routed_alike(frame, picked),  # a MoE run: the frame compared its routing
            }
        return rows

    def add_pairs(self, rows: Rows) -> None:
        same = same_sample(rows)
        ok_r, ok_c = rows["ok_ref"], rows["ok_cand"]
        lp_r, lp_c = rows["lp_ref"].astype(np.float64), rows["lp_cand"].astype(np.float64)
        # later: the candidate's row p+1 holds what the reference has at p; earlier: its row p-1 does
        for name, use, diff in (
            ("later", same & ok_r[:-1] & ok_c[1:], lambda u: lp_c[1:][u] - lp_r[:-1][u]),
            ("earlier", same & ok_r[1:] & ok_c[:-1], lambda u: lp_c[:-1][u] - lp_r[1:][u]),
        ):
            self.s[f"n_{name}"] += int(np.count_nonzero(use))
            self.s[f"abs_{name}"] += float(np.abs(diff(use)).sum())
        # running sums (cumulative_logprobs): a side's step from row p to p+1 against the other's row p+1
        use = same & ok_r[:-1] & ok_c[:-1] & ok_r[1:] & ok_c[1:]
        self.s["n_cum"] += int(np.count_nonzero(use))
        self.s["cum_stored"] += float(np.abs(lp_r[1:][use] - lp_c[1:][use]).sum())
        for name, a, b in (("ref", lp_r, lp_c), ("cand", lp_c, lp_r)):
            self.s[f"cum_{name}"] += float(np.abs(a[1:][use] - a[:-1][use] - b[1:][use]).sum())
        if "ex_ref" in rows:
            self._route_pairs(rows, same)

    def _route_pairs(self, rows: Rows, same: np.ndarray) -> None:
        rv_r, rv_c = rows["rv_ref"], rows["rv_cand"]
        pick = same & rows["picked"][:-1]
        a = np.flatnonzero(pick & rv_r[:-1] & rv_c[:-1] & rv_r[1:] & rv_c[1:])
        if not len(a):
            return
        ref, cand = rows["ex_ref"], rows["ex_cand"]
        self.s["route_pairs"] += len(a)
        self.s["route_same"] += int(np.count_nonzero(rows["alike"][a]))  # the frame's own comparison
        self.s["route_later"] += _pairs_routed_alike(ref, a, cand, a + 1)
        self.s["route_earlier"] += _pairs_routed_alike(ref, a + 1, cand, a)

    def add_sums(self, other: PairStats) -> None:
        for key, value in other.s.items():
            self.s[key] += value

    def finish(self) -> dict:
        return dict(self.s)
