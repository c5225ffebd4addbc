"""The N response tokens of a comparison with the largest |delta|, kept as a running top-N while the report streams.

Per chunk only the rows that beat the current N-th |delta| are looked at, so the usual cost is one
comparison over the chunk. Ties go to the smaller (sample_id, position): rows arrive in that order,
so a later row never displaces a kept row of equal |delta|.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .compare import SideChunk
from .errors import ProbeError
from .routing_metrics import expert_bit_table, expert_set_diff
from .schema import RoutingShape

DEFAULT_WORST = 20


def parse_worst(value) -> int:
    """--worst N: how many tokens to list per comparison; 0 lists none."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ProbeError(f"--worst: {value!r}, expected an integer >= 0")
    return int(value)


def _top_rows(score: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """The n candidates of largest score; among equal scores at the cut, the earliest rows."""
    values = score[candidates]
    kth = values[np.argpartition(-values, n - 1)[:n]].min()
    above = candidates[values > kth]
    tied = candidates[values == kth][: n - len(above)]
    return np.concatenate([above, tied])


def _side_top(chunk: SideChunk, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if chunk.top is None:
        return np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=bool)
    return chunk.top[0][rows].astype(np.int64), chunk.top[1][rows]


def _side_experts(chunk: SideChunk, rows: np.ndarray, shape: RoutingShape) -> tuple[np.ndarray, np.ndarray]:
    if chunk.experts is None:
        empty = np.zeros((len(rows), shape.num_layers, shape.top_k), dtype=np.int64)
        return empty, np.zeros(len(rows), dtype=bool)
    return chunk.experts[rows].astype(np.int64), chunk.experts_valid[rows]


@dataclass
class WorstTokens:
    """Running top-N by |delta| as columns (best first); `entries` are the JSON rows after `finish`."""

    limit: int
    shape: RoutingShape
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    entries: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _floor(self) -> float:
        """|delta| a new row must exceed to enter: the N-th kept one, or -1 while fewer are kept."""
        if not self.kept or len(self.kept["abs_delta"]) < self.limit:
            return -1.0
        return float(self.kept["abs_delta"][-1])

    def update(self, rows: np.ndarray, delta: np.ndarray, response_index: np.ndarray,
               ref: SideChunk, cand: SideChunk) -> None:
        """rows: the chunk rows compared; delta: theirs; response_index: per chunk row."""
        if self.limit == 0 or rows.size == 0:
            return
        score = np.abs(delta)
        pick = np.flatnonzero(score > self._floor())
        if pick.size > self.limit:
            pick = _top_rows(score, pick, self.limit)
        if pick.size == 0:
            return
        self._merge(self._columns(rows[pick], delta[pick], response_index, ref, cand))

    def _columns(self, rows, delta, response_index, ref: SideChunk, cand: SideChunk) -> dict[str, np.ndarray]:
        columns = {
            "abs_delta": np.abs(delta), "delta": delta,
            "sample_id": ref.sample_id[rows].astype(np.int64), "position": ref.position[rows].astype(np.int64),
            "response_index": response_index[rows], "token_id": ref.token_id[rows].astype(np.int64),
            "logprob_ref": ref.logprob[rows].astype(np.float64), "logprob_cand": cand.logprob[rows].astype(np.float64),
        }  # fmt: skip
        columns["top_ref"], columns["top_ref_valid"] = _side_top(ref, rows)
        columns["top_cand"], columns["top_cand_valid"] = _side_top(cand, rows)
        if self.shape.is_moe:
            columns["experts_ref"], columns["experts_ref_valid"] = _side_experts(ref, rows, self.shape)
            columns["experts_cand"], columns["experts_cand_valid"] = _side_experts(cand, rows, self.shape)
        return columns

    def _merge(self, new: dict[str, np.ndarray]) -> None:
        both = {key: np.concatenate([self.kept[key], value]) for key, value in new.items()} if self.kept else new
        order = np.lexsort((both["position"], both["sample_id"], -both["abs_delta"]))[: self.limit]
        self.kept = {key: value[order] for key, value in both.items()}

    def routing_diff_layers(self) -> list[int | None]:
        """Per kept token: MoE layers whose expert set differs (None where a side has no routing there)."""
        if not self.kept or not self.shape.is_moe:
            return [None] * len(self.kept.get("abs_delta", ()))
        ref, cand = self.kept["experts_ref"], self.kept["experts_cand"]
        k = self.shape.top_k
        diff = expert_set_diff(ref.reshape(-1, k), cand.reshape(-1, k), expert_bit_table(self.shape.num_experts))
        layers = (diff.reshape(len(ref), -1) > 0).sum(axis=1)
        both = self.kept["experts_ref_valid"] & self.kept["experts_cand_valid"]
        return [int(n) if ok else None for n, ok in zip(layers, both)]

    def finish(self) -> None:
        """Turn the kept columns into the JSON entries (texts null until a tokenizer fills them in)."""
        if not self.kept:
            return
        k = self.kept
        routing = self.routing_diff_layers()

        def top(side: str, i: int) -> int | None:
            return int(k[f"top_{side}"][i]) if k[f"top_{side}_valid"][i] else None

        for i, diff_layers in enumerate(routing):
            lp_ref, lp_cand = float(k["logprob_ref"][i]), float(k["logprob_cand"][i])
            self.entries.append({
                "sample_id": int(k["sample_id"][i]), "position": int(k["position"][i]),
                "response_index": int(k["response_index"][i]), "token_id": int(k["token_id"][i]), "token": None,
                "logprob_ref": lp_ref, "logprob_cand": lp_cand, "p_ref": float(np.exp(lp_ref)),
                "p_cand": float(np.exp(lp_cand)), "delta": float(k["delta"][i]),
                "top_token_id_ref": top("ref", i), "top_token_id_cand": top("cand", i),
                "top_token_ref": None, "top_token_cand": None, "routing_diff_layers": diff_layers,
                "context": {"prompt_tail": None, "response_before": None},
            })  # fmt: skip
