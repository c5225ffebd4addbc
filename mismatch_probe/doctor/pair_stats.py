"""Per comparison: the sums every doctor check on a pair of sides reads, streamed like the report.

All sums are additive, so two ranges merge exactly (floats up to the order of addition); shifted pairs that
straddle a boundary are paired by `Pairwise`. Routing shifts are checked on one (token) pair in
ROUTE_SAMPLE, chosen by a hash of (sample, position): a pure function of the row, so a split report picks
the same pairs, and the routing arithmetic stays a small fraction of the report's.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mismatch_probe.doctor.pairwise import Pairwise, Rows, same_sample
from mismatch_probe.report.routing import differing_slots, expert_bit_table, expert_set_diff

ROUTE_SAMPLE = 8


def _picked(sample_id: np.ndarray, position: np.ndarray) -> np.ndarray:
    mixed = (sample_id.astype(np.uint64) * np.uint64(2654435761) + position.astype(np.uint64)) * np.uint64(40503)
    return (mixed >> np.uint64(13)) % np.uint64(ROUTE_SAMPLE) == 0


def _tokens_routed_alike(x: np.ndarray, y: np.ndarray) -> int:
    """How many rows of [m, layers, top_k] expert ids hold the same expert set as `y` in every layer, whatever
    the order of ids within a set. Byte-identical slots settle most; the rest are compared as bitmask sets
    (the report's own routing comparison) in two rounds: first each token's first non-identical slot, which
    settles nearly every token of a shifted comparison, then every such slot of the tokens still alike."""
    m, layers, k = x.shape
    differs = differing_slots(x, y)  # [m, layers]
    suspects = np.flatnonzero(differs.any(axis=1))
    if not len(suspects):
        return m
    bits = expert_bit_table(int(max(x.max(), y.max())) + 1)
    first = differs[suspects].argmax(axis=1)
    apart = expert_set_diff(x[suspects, first], y[suspects, first], bits) > 0
    rest = suspects[~apart]  # reordered in their first slot: look at all their slots
    token, layer = np.nonzero(differs[rest])
    apart_rest = np.zeros(len(rest), dtype=bool)
    if len(token):
        slot_apart = expert_set_diff(x[rest[token], layer], y[rest[token], layer], bits) > 0
        np.logical_or.at(apart_rest, token, slot_apart)
    return m - int(np.count_nonzero(apart)) - int(np.count_nonzero(apart_rest))


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
        same = frame.routing.rows.copy()
        same[frame.routing.slot_token] = False
        picked = same[frame.compared]
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
            rows |= {
                "ex_ref": frame.ref.experts,
                "ex_cand": frame.cand.experts,
                "rv_ref": frame.ref.experts_valid,
                "rv_cand": frame.cand.experts_valid,
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
        if "ex_ref" in rows:
            self._route_pairs(rows, same)

    def _route_pairs(self, rows: Rows, same: np.ndarray) -> None:
        rv_r, rv_c = rows["rv_ref"], rows["rv_cand"]
        pick = same & _picked(rows["sample_id"][:-1], rows["position"][:-1])
        a = np.flatnonzero(pick & rv_r[:-1] & rv_c[:-1] & rv_r[1:] & rv_c[1:])
        if not len(a):
            return
        ref_a, ref_b = rows["ex_ref"][a], rows["ex_ref"][a + 1]
        cand_a, cand_b = rows["ex_cand"][a], rows["ex_cand"][a + 1]
        equal = _tokens_routed_alike
        self.s["route_pairs"] += len(a)
        self.s["route_same"] += equal(ref_a, cand_a)
        self.s["route_later"] += equal(ref_a, cand_b)
        self.s["route_earlier"] += equal(ref_b, cand_a)

    def add_sums(self, other: PairStats) -> None:
        for key, value in other.s.items():
            self.s[key] += value

    def finish(self) -> dict:
        return dict(self.s)
