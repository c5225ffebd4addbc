"""One comparison's view of one chunk of aligned rows, built once and read by every accumulator.

Per chunk, the rows' sequences (a segment index per row), response index and routing scope are found once
for all comparisons (`ChunkRows`). Per comparison, the masks, delta, |delta|, k3 and the rest are computed
on first use and then shared (`PairFrame`), and the expert sets are compared once (`compare_routing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from mismatch_probe.frames.align import SideChunk
from mismatch_probe.frames.bootstrap import RESAMPLES, poisson_weights
from mismatch_probe.frames.expert_sets import RoutedRows, compare_routing, expert_bit_table
from mismatch_probe.frames.previous_row import PreviousRow
from mismatch_probe.schema import RoutingShape


@dataclass
class ResponseIndex:
    """Index of each row within its sample's response (0 = first response token), carried across chunks,
    since a sequence may be split between chunks. Values on prompt rows are meaningless."""

    last_sample: int = -1
    last_is_response: bool = False
    start: int = 0  # first response position of last_sample

    def update(self, sample_id: np.ndarray, position: np.ndarray, is_response: np.ndarray) -> np.ndarray:
        n = len(sample_id)
        continues = np.empty(n, dtype=bool)  # the row before is a response row of the same sample
        continues[0] = self.last_is_response and int(sample_id[0]) == self.last_sample
        continues[1:] = is_response[:-1] & (sample_id[1:] == sample_id[:-1])
        starts = is_response & ~continues
        latest = np.maximum.accumulate(np.where(starts, np.arange(n), -1))
        start = np.where(latest >= 0, position[np.maximum(latest, 0)].astype(np.int64), self.start)
        self.last_sample, self.last_is_response = int(sample_id[-1]), bool(is_response[-1])
        if self.last_is_response:
            self.start = int(start[-1])
        return position.astype(np.int64) - start


@dataclass
class ChunkRows:
    """What every comparison of a chunk shares: its rows' keys, sequences, response index and routing scope."""

    sample_id: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    is_response: np.ndarray
    response_index: np.ndarray  # per row (meaningless on prompt rows)
    routing_scope: np.ndarray  # [n] bool: rows whose routing is compared
    segment: np.ndarray  # [n] which of the chunk's sequences each row belongs to: 0, 1, 2...
    segment_ids: np.ndarray  # [m] int64 sample id of each of those sequences, ascending

    @classmethod
    def of(cls, chunk: SideChunk, tracker: ResponseIndex, response_scope: bool) -> ChunkRows:
        sample_id = chunk.sample_id
        starts = np.flatnonzero(sample_id[1:] != sample_id[:-1]) + 1
        segment = np.zeros(len(sample_id), dtype=np.int64)
        segment[starts] = 1
        np.cumsum(segment, out=segment)
        return cls(
            sample_id=sample_id,
            position=chunk.position,
            token_id=chunk.token_id,
            is_response=chunk.is_response,
            response_index=tracker.update(sample_id, chunk.position, chunk.is_response),
            routing_scope=chunk.is_response if response_scope else np.ones(len(sample_id), dtype=bool),
            segment=segment,
            segment_ids=sample_id[np.concatenate([[0], starts])].astype(np.int64),
        )

    @cached_property
    def weights(self) -> np.ndarray:
        """[sequences, resamples] Poisson bootstrap weights of the chunk's sequences (bootstrap.py)."""
        return poisson_weights(self.segment_ids)

    @property
    def has_weights(self) -> bool:
        """Whether `weights` has been computed for this chunk (cached_property keeps it in the instance)."""
        return "weights" in self.__dict__

    def weights_of(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), resamples] weights of these sample ids: the chunk's rows where it holds them (computed
        once per chunk for every accumulator and comparison), the rest computed here."""
        at = np.minimum(np.searchsorted(self.segment_ids, ids), len(self.segment_ids) - 1)
        held = self.segment_ids[at] == ids
        if held.all():
            return self.weights[at]
        out = np.empty((len(ids), RESAMPLES))
        out[held] = self.weights[at[held]]
        out[~held] = poisson_weights(ids[~held])
        return out


@dataclass
class PairFrame:
    """One comparison over one chunk. `compared` are the rows of SPEC section 5: response tokens with a finite
    log-prob on both sides; delta, k3... are over those rows, in float64."""

    rows: ChunkRows
    ref: SideChunk
    cand: SideChunk
    routing: RoutedRows | None = None  # expert-set differences; None for a dense model
    fp32: SideChunk | None = None  # the fp32 score set of comparisons whose error is split per side
    extra: dict[str, SideChunk] = field(default_factory=dict)  # further sides a comparison reads (policy/)
    # name -> (has, columns): per row, the values a row function gave for row p - 1 (the routing row of the
    # forward that scored token p), and whether that row is in the sample; see FrameBuilder.frames
    before: dict[str, tuple] = field(default_factory=dict)

    @cached_property
    def ref_ok(self) -> np.ndarray:
        """Response rows with a (non-null) reference log-prob."""
        return self.ref.logprob_valid & self.rows.is_response

    @cached_property
    def cand_ok(self) -> np.ndarray:
        return self.cand.logprob_valid & self.rows.is_response

    @cached_property
    def finite_ref(self) -> np.ndarray:
        return np.isfinite(self.ref.logprob)

    @cached_property
    def finite_cand(self) -> np.ndarray:
        return np.isfinite(self.cand.logprob)

    @cached_property
    def use(self) -> np.ndarray:
        """[n] bool: the rows compared."""
        return self.ref_ok & self.cand_ok & self.finite_ref & self.finite_cand

    @cached_property
    def compared(self) -> np.ndarray:
        """Row index of each compared token, ascending."""
        return np.flatnonzero(self.use)

    @cached_property
    def lp_ref(self) -> np.ndarray:
        return self.ref.logprob[self.compared].astype(np.float64)

    @cached_property
    def lp_cand(self) -> np.ndarray:
        return self.cand.logprob[self.compared].astype(np.float64)

    @cached_property
    def delta(self) -> np.ndarray:
        """log r = logprob_cand - logprob_ref."""
        return self.lp_cand - self.lp_ref

    @cached_property
    def abs_delta(self) -> np.ndarray:
        return np.abs(self.delta)

    @cached_property
    def k3(self) -> np.ndarray:
        """r - 1 - log r; expm1 keeps it accurate when r is within rounding of 1."""
        return np.expm1(self.delta) - self.delta

    @cached_property
    def r(self) -> np.ndarray:
        return np.exp(self.delta)

    @cached_property
    def ratio_max(self) -> np.ndarray:
        """max(r, 1/r), the quantity every threshold T is compared with."""
        return np.exp(self.abs_delta)

    @cached_property
    def p_ref(self) -> np.ndarray:
        return np.exp(self.lp_ref)

    @cached_property
    def p_cand(self) -> np.ndarray:
        return np.exp(self.lp_cand)

    @cached_property
    def segment(self) -> np.ndarray:
        """The chunk sequence of each compared token."""
        return self.rows.segment[self.compared]


@dataclass
class FrameBuilder:
    """Builds the frames of each chunk for a list of comparisons: (reference, candidate, fp32 side or None)."""

    shape: RoutingShape
    routing_scope: str = "all"  # or "response"
    tracker: ResponseIndex | None = None  # a range that starts inside a response continues its tracker

    def __post_init__(self):
        self.tracker = self.tracker or ResponseIndex()
        self.carries: dict[tuple[int, str], PreviousRow] = {}
        self.bit_table = expert_bit_table(self.shape.num_experts) if self.shape.is_moe else None

    def frames(self, chunks: dict[str, SideChunk], pairs: list[tuple], row_functions=None) -> list[PairFrame]:
        """pairs: (reference, candidate, fp32 side or None[, extra sides]) per comparison. row_functions: per
        comparison, {name: frame -> per-row columns} whose values at row p - 1 each frame gets in `before[name]`,
        carried across chunks here, where chunks come in order (the accumulators of a range cut inside a
        sequence would not have the row before)."""
        rows = ChunkRows.of(next(iter(chunks.values())), self.tracker, self.routing_scope == "response")
        frames = []
        for i, (ref, cand, fp32, *extra) in enumerate(pairs):
            frame = self._frame(rows, chunks[ref], chunks[cand], chunks.get(fp32))
            frame.extra = {side: chunks[side] for side in (extra[0] if extra else ())}
            for name, function in (row_functions[i] if row_functions else {}).items():
                carry = self.carries.setdefault((i, name), PreviousRow())
                frame.before[name] = carry.shift(rows.sample_id, rows.position, *function(frame))
            frames.append(frame)
        return frames

    def _frame(self, rows: ChunkRows, ref: SideChunk, cand: SideChunk, fp32: SideChunk | None) -> PairFrame:
        routing = None
        if self.shape.is_moe:
            routing = compare_routing(
                ref.experts,
                ref.experts_valid & rows.routing_scope,
                cand.experts,
                cand.experts_valid,
                self.shape.num_layers,
                self.bit_table,
            )
        return PairFrame(rows=rows, ref=ref, cand=cand, routing=routing, fp32=fp32)
