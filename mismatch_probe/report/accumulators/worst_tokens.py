"""The N response tokens of a comparison with the largest |delta|, kept as a running top-N while the report streams.

Per chunk only the rows that beat the current N-th |delta| are looked at, so the usual cost is one
comparison over the chunk. Ties go to the smaller (sample_id, position): the kept tokens are ranked by
(-|delta|, sample_id, position), a total order, so whatever the chunks and however ranges are merged,
the same N tokens are kept in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.frames.align import SideChunk

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame


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


@dataclass
class WorstTokens:
    """Running top-N by |delta| as columns (best first); `entries` are the JSON rows after `finish`."""

    limit: int
    kept: dict[str, np.ndarray] = field(default_factory=dict)
    entries: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _floor(self) -> float:
        """|delta| a new row must exceed to enter: the N-th kept one, or -1 while fewer are kept."""
        if not self.kept or len(self.kept["abs_delta"]) < self.limit:
            return -1.0
        return float(self.kept["abs_delta"][-1])

    def update(self, frame: PairFrame) -> None:
        if self.limit == 0 or frame.compared.size == 0:
            return
        score = frame.abs_delta
        # Rows arrive in (sample_id, position) order: one tying with the N-th kept |delta| ranks after it.
        pick = np.flatnonzero(score > self._floor())
        if pick.size > self.limit:
            pick = _top_rows(score, pick, self.limit)
        if pick.size == 0:
            return
        self._keep(self._columns(frame, pick))

    def merge(self, other: WorstTokens) -> None:
        if other.kept:
            self._keep(other.kept)

    def _columns(self, frame: PairFrame, pick: np.ndarray) -> dict[str, np.ndarray]:
        """The picked compared tokens (indices into frame.compared) with everything their entries show."""
        rows, keys = frame.compared[pick], frame.rows
        columns = {
            "abs_delta": frame.abs_delta[pick],
            "delta": frame.delta[pick],
            "sample_id": keys.sample_id[rows].astype(np.int64),
            "position": keys.position[rows].astype(np.int64),
            "response_index": keys.response_index[rows],
            "token_id": keys.token_id[rows].astype(np.int64),
            "logprob_ref": frame.lp_ref[pick],
            "logprob_cand": frame.lp_cand[pick],
        }
        columns["top_ref"], columns["top_ref_valid"] = _side_top(frame.ref, rows)
        columns["top_cand"], columns["top_cand_valid"] = _side_top(frame.cand, rows)
        routing = frame.routing  # MoE layers whose expert sets differ; -1 where a side has no routing there
        columns["routing_diff_layers"] = (
            np.full(len(rows), -1)
            if routing is None
            else np.where(routing.rows[rows], routing.layers_differing[rows], -1)
        )
        return columns

    def _keep(self, new: dict[str, np.ndarray]) -> None:
        both = {key: np.concatenate([self.kept[key], value]) for key, value in new.items()} if self.kept else new
        order = np.lexsort((both["position"], both["sample_id"], -both["abs_delta"]))[: self.limit]
        self.kept = {key: value[order] for key, value in both.items()}

    def finish(self) -> dict:
        """The kept columns as JSON entries (texts null until token_context fills them in, in place)."""
        if not self.kept or self.entries:
            return {"worst_tokens": self.entries}
        k = self.kept

        def top(side: str, i: int) -> int | None:
            return int(k[f"top_{side}"][i]) if k[f"top_{side}_valid"][i] else None

        for i, diff_layers in enumerate(k["routing_diff_layers"].tolist()):
            lp_ref, lp_cand = float(k["logprob_ref"][i]), float(k["logprob_cand"][i])
            self.entries.append(
                {
                    "sample_id": int(k["sample_id"][i]),
                    "position": int(k["position"][i]),
                    "response_index": int(k["response_index"][i]),
                    "token_id": int(k["token_id"][i]),
                    "token": None,
                    "logprob_ref": lp_ref,
                    "logprob_cand": lp_cand,
                    "p_ref": float(np.exp(lp_ref)),
                    "p_cand": float(np.exp(lp_cand)),
                    "delta": float(k["delta"][i]),
                    "top_token_id_ref": top("ref", i),
                    "top_token_id_cand": top("cand", i),
                    "top_token_ref": None,
                    "top_token_cand": None,
                    "routing_diff_layers": diff_layers if diff_layers >= 0 else None,
                    "context": {"prompt_tail": None, "response_before": None},
                }
            )
        return {"worst_tokens": self.entries}
