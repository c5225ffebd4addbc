"""The contract every training engine shares: which positions are scored, where each sequence sits in
the padded micro-batch, which experts a replay forces, how records are assembled, and who writes them.

Scored positions: response positions p >= max(prompt_len, 1). Position p's log-prob comes from the
hidden state at p - 1; position 0 has no predecessor, so an empty prompt scores from position 1.

Replay (R3) is asked for by a request that carries `replay_experts`; a request without them is
routed freely. Positions whose `replay_valid` is False (the last sampled token, which the
inference engine never forwarded) are routed freely by the training router in the same forward.
A replay request with experts for no position at all is an error: the rollout has no routing to
replay, and scoring it freely under an R3 label would hide that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord


def is_writer_rank() -> bool:
    """Under torchrun every rank computes the same records; only rank 0 writes them."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def scored_positions(request: ScoreRequest) -> np.ndarray:
    """Positions of `request` whose log-prob is scored."""
    return np.arange(max(request.prompt_len, 1), len(request))


@dataclass(frozen=True)
class ScoreTargets:
    """Every scored position of a micro-batch, flattened in request order."""

    rows: np.ndarray  # grid row of the sequence
    columns: np.ndarray  # grid column of the hidden state that predicts the token (its position - 1)
    token_ids: np.ndarray  # the token to score
    counts: np.ndarray  # scored positions per request


@dataclass(frozen=True)
class BatchGrid:
    """Where each sequence of a micro-batch sits in the padded `[rows, width]` token grid."""

    lengths: np.ndarray
    starts: np.ndarray  # grid column of each sequence's position 0
    width: int

    @staticmethod
    def left_padded(batch: list[ScoreRequest], extra_padding: int = 0) -> BatchGrid:
        """Padding before each sequence, as `generate` pads its prompts."""
        lengths = np.array([len(r) for r in batch], dtype=np.int64)
        width = int(lengths.max()) + extra_padding
        return BatchGrid(lengths=lengths, starts=width - lengths, width=width)

    @staticmethod
    def right_padded(batch: list[ScoreRequest], extra_padding: int = 0) -> BatchGrid:
        """Padding after each sequence: causal attention keeps it out of every real position."""
        lengths = np.array([len(r) for r in batch], dtype=np.int64)
        return BatchGrid(lengths=lengths, starts=np.zeros_like(lengths), width=int(lengths.max()) + extra_padding)

    def real(self) -> np.ndarray:
        """`[rows, width]` bool: True where a sequence's token sits, False on padding."""
        columns = np.arange(self.width)
        return (columns >= self.starts[:, None]) & (columns < (self.starts + self.lengths)[:, None])

    def tokens(self, batch: list[ScoreRequest], pad_id: int) -> torch.Tensor:
        """`[rows, width]` int64 token grid, `pad_id` on padding."""
        grid = np.full((len(batch), self.width), pad_id, dtype=np.int64)
        grid[self.real()] = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in batch])
        return torch.from_numpy(grid)

    def targets(self, batch: list[ScoreRequest]) -> ScoreTargets:
        positions = [scored_positions(r) for r in batch]
        counts = np.array([len(p) for p in positions], dtype=np.int64)
        rows = np.repeat(np.arange(len(batch)), counts)
        flat = np.concatenate(positions)
        return ScoreTargets(
            rows=rows,
            columns=self.starts[rows] + flat - 1,
            token_ids=np.concatenate([np.asarray(r.token_ids, dtype=np.int64)[p] for r, p in zip(batch, positions)]),
            counts=counts,
        )

    def replay(self, batch: list[ScoreRequest], model: ModelInfo) -> tuple[np.ndarray, np.ndarray] | None:
        """`[rows, width, L, k]` int64 expert ids and the `[rows, width]` mask of positions they force;
        None when no request asks for replay. Unforced ids are 0..k-1 (never used)."""
        if all(r.replay_experts is None for r in batch):
            return None
        ids, force = self._expert_grid(batch, model)
        for row, request in enumerate(batch):
            if request.replay_experts is None:
                continue
            layers, k = ids.shape[2:]
            experts, valid = checked_replay(request, layers, k, model.num_experts)
            columns = self.starts[row] + np.flatnonzero(valid)
            ids[row, columns] = experts[valid]
            force[row, columns] = True
        return ids, force

    def old_experts(self, batch: list[ScoreRequest], model: ModelInfo) -> np.ndarray | None:
        """`[rows, width, L, k]` int64: the experts the --old score set chose at each position, where a
        new-policy pass reads its router's log-probs (RSPO's router shift); None when no request carries them.
        Padding holds 0..k-1 (read, never stored)."""
        if all(r.old_experts is None for r in batch):
            return None
        ids, _ = self._expert_grid(batch, model)
        for row, request in enumerate(batch):
            if request.old_experts is not None:
                ids[row, self.starts[row] : self.starts[row] + len(request)] = request.old_experts
        return ids

    def _expert_grid(self, batch: list[ScoreRequest], model: ModelInfo) -> tuple[np.ndarray, np.ndarray]:
        layers, k = len(model.moe_layer_indices), model.top_k
        if not layers:
            raise ProbeError(f"{model.path}: replay needs an MoE model, but config.json describes a dense one")
        ids = np.broadcast_to(np.arange(k, dtype=np.int64), (len(batch), self.width, layers, k)).copy()
        return ids, np.zeros((len(batch), self.width), dtype=bool)


def checked_replay(request: ScoreRequest, layers: int, top_k: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The request's replay experts `[n, L, k]` and validity `[n]`, or a ProbeError naming the sample."""
    n, sample = len(request), request.sample_id
    experts = np.asarray(request.replay_experts)
    valid = np.ones(n, dtype=bool) if request.replay_valid is None else np.asarray(request.replay_valid, dtype=bool)
    if experts.shape != (n, layers, top_k):
        raise ProbeError(f"sample {sample}: replay experts have shape {experts.shape}, expected {(n, layers, top_k)}")
    if valid.shape != (n,):
        raise ProbeError(f"sample {sample}: replay validity has shape {valid.shape}, expected {(n,)}")
    if not valid.any():
        raise ProbeError(
            f"sample {sample}: replay asked for, but the rollout has routed experts for none of its {n} positions "
            "(the inference engine returned no routing; rescore without --replay r3)"
        )
    chosen = experts[valid].astype(np.int64)
    if chosen.max() >= num_experts:
        raise ProbeError(f"sample {sample}: replay expert id {int(chosen.max())} >= num_experts {num_experts}")
    if chosen.min() < 0:
        raise ProbeError(f"sample {sample}: replay expert id {int(chosen.min())} < 0")
    return experts.astype(np.int64), valid


def assemble_records(
    batch: list[ScoreRequest],
    grid: BatchGrid,
    scored: tuple[torch.Tensor, ...],
    routing: np.ndarray | None,
    model: ModelInfo,
    margins: np.ndarray | None = None,
    router_logprobs: tuple[np.ndarray, np.ndarray | None] | None = None,
) -> list[SequenceRecord]:
    """Records from the flat `(logprob, top_id, top_logprob[, kept_logmass])` of `grid.targets(batch)`, the
    `[rows, width, L, k]` routing of every grid cell and, where the engine captures them, its
    `[rows, width, L]` router margins. Unscored positions hold 0 and are masked; every forwarded
    position has routing. `router_logprobs`: `[rows, width, L, k]` the router's log-probs at its chosen
    experts and, for a new-policy pass, at the --old set's experts (else None). With `kept_logmass`
    (`--sampling rollout`), a token outside the side's own support (log-prob -inf) is stored as null."""
    values = [v.numpy() for v in scored]
    records, offset = [], 0
    for row, request in enumerate(batch):
        n = len(request)
        valid = np.zeros(n, dtype=bool)
        valid[scored_positions(request)] = True
        count = int(valid.sum())
        logprob, top_id, top_logprob, *kept = (_spread(v[offset : offset + count], valid) for v in values)
        offset += count
        scored_valid = valid & np.isfinite(logprob) if kept else valid
        record = request.record(
            logprob,
            scored_valid,
            top_token_id=top_id.astype(np.int64),
            top_logprob=top_logprob.astype(np.float32),
            kept_logmass=kept[0].astype(np.float32) if kept else None,
        )
        if routing is not None:
            start = grid.starts[row]
            record.experts = routing[row, start : start + n].astype(model.routing.id_dtype)
            record.experts_valid = np.ones(n, dtype=bool)
            if margins is not None:
                record.router_margin = margins[row, start : start + n].astype(np.float32)
            if router_logprobs is not None:
                chosen, at_old = router_logprobs
                record.expert_logprobs = chosen[row, start : start + n].astype(np.float32)
                if at_old is not None:
                    record.expert_logprobs_at_old = at_old[row, start : start + n].astype(np.float32)
        records.append(record)
    return records


def _spread(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    out = np.zeros(len(valid), dtype=values.dtype)
    out[valid] = values
    return out
