"""Stream several sides of a run row-aligned, validating that they describe the same tokens.

Sides are read once each, row group by row group, only the needed columns; row-group boundaries
of different sides need not match, so the streams are cut at the shortest remaining batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.checked import MAX_LOGPROB
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import (
    SampleRange,
    first_unordered_row,
    iter_batches,
    open_part,
    require_no_nulls,
    require_parts,
)
from mismatch_probe.schema import (
    EXPERT_LOGPROBS,
    EXPERT_LOGPROBS_AT_OLD,
    KEPT_LOGMASS,
    ROUTER_MARGIN,
    RoutingShape,
    experts_matrix,
    routing_matrix,
)

KEY_COLUMNS = ("sample_id", "position", "token_id")


@dataclass
class SideChunk:
    """One side's slice of aligned rows, as numpy views."""

    path: Path
    sample_id: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    is_response: np.ndarray
    logprob: np.ndarray
    logprob_valid: np.ndarray
    top: tuple[np.ndarray, np.ndarray] | None = None  # (top_token_id, valid)
    top_logprob: tuple[np.ndarray, np.ndarray] | None = None  # (top_logprob, valid): the doctor's temperature fit
    experts: np.ndarray | None = None  # [n, layers, k]
    experts_valid: np.ndarray | None = None
    router_margin: tuple[np.ndarray, np.ndarray] | None = None  # ([n, layers] float32, valid)
    # ([n, layers, k] float32, valid): the router's log-probs at its experts, and at the --old set's experts
    expert_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    expert_logprobs_at_old: tuple[np.ndarray, np.ndarray] | None = None
    # (kept_logmass, valid): the log mass of the top-p/top-k support each response token was scored over, where
    # the side records it (schema.KEPT_LOGMASS); a token outside that support has a null log-prob
    kept_logmass: tuple[np.ndarray, np.ndarray] | None = None


def _values(column: pa.Array, dtype) -> np.ndarray:
    """Zero-copy values of a primitive column; null slots hold whatever the writer left there."""
    data = column.buffers()[1]
    if data is None:  # an all-null column may carry no data buffer
        return np.zeros(len(column), dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=column.offset + len(column))[column.offset :]


def _valid(column: pa.Array) -> np.ndarray:
    if column.null_count == 0:
        return np.ones(len(column), dtype=bool)
    return column.is_valid().to_numpy(zero_copy_only=False)


def _to_chunk(path: Path, batch: pa.RecordBatch, shape: RoutingShape) -> SideChunk:
    col = batch.column
    names = batch.schema.names
    require_no_nulls(path, batch, (*KEY_COLUMNS, "is_response"))
    chunk = SideChunk(
        path=path,
        sample_id=_values(col("sample_id"), np.uint32),
        position=_values(col("position"), np.uint32),
        token_id=_values(col("token_id"), np.uint32),
        is_response=col("is_response").to_numpy(zero_copy_only=False),
        logprob=_values(col("logprob"), np.float32),
        logprob_valid=_valid(col("logprob")),
    )
    if "top_token_id" in names:
        chunk.top = (_values(col("top_token_id"), np.uint32), _valid(col("top_token_id")))
    if "top_logprob" in names:
        chunk.top_logprob = (_values(col("top_logprob"), np.float32), _valid(col("top_logprob")))
    if KEPT_LOGMASS in names:
        chunk.kept_logmass = (_values(col(KEPT_LOGMASS), np.float32), _valid(col(KEPT_LOGMASS)))
    if "experts" in names:
        chunk.experts, chunk.experts_valid = experts_matrix(col("experts"), shape, str(path))
    if ROUTER_MARGIN in names:
        chunk.router_margin = routing_matrix(col(ROUTER_MARGIN), shape.num_layers, f"{path}: column '{ROUTER_MARGIN}'")
    for name in (EXPERT_LOGPROBS, EXPERT_LOGPROBS_AT_OLD):
        if name in names:
            values, valid = routing_matrix(col(name), shape.width, f"{path}: column '{name}'")
            setattr(chunk, name, (values.reshape(len(values), shape.num_layers, shape.top_k), valid))
    return chunk


def side_columns(run: Run, side: str, shape: RoutingShape) -> list[str]:
    """The columns a comparison needs from this side. An optional column is read where every part of the
    side has it; one that only some parts have is an error naming a part without it."""
    parts = require_parts(run.side_dir(side))
    names = [set(open_part(part, shape).schema_arrow.names) for part in parts]
    columns = [*KEY_COLUMNS, "is_response", "logprob", *(("experts",) if shape.is_moe else ())]
    routing = (ROUTER_MARGIN, EXPERT_LOGPROBS, EXPERT_LOGPROBS_AT_OLD) if shape.is_moe else ()
    for name in ("top_token_id", "top_logprob", KEPT_LOGMASS, *routing):
        having = [name in part_names for part_names in names]
        if all(having):
            columns.append(name)
        elif any(having):
            lacking = parts[having.index(False)]
            raise ProbeError(f"{lacking}: missing column '{name}' (other parts of this side have it)")
    return columns


def prefetched(items: Iterator, depth: int = 1) -> Iterator:
    """Run an iterator in a background thread so Parquet decoding overlaps the metric arithmetic."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as exc:  # re-raised in the consumer, where it belongs
            q.put(("error", exc))

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


@dataclass
class _Stream:
    side: str
    batches: Iterator
    path: Path | None = None
    batch: pa.RecordBatch | None = None
    offset: int = 0
    last: tuple[int, int] | None = None  # (sample, position) of the last row handed out

    def remaining(self) -> int:
        return 0 if self.batch is None else self.batch.num_rows - self.offset

    def refill(self) -> bool:
        while self.remaining() == 0:
            nxt = next(self.batches, None)
            if nxt is None:
                return False
            self.path, self.batch = nxt
            self.offset = 0
        return True


def aligned_chunks(
    run: Run,
    sides: list[str],
    shape: RoutingShape,
    samples: SampleRange | None = None,
    expert_ids: bool = True,
    logprobs_only: bool = False,
) -> Iterator[dict[str, SideChunk]]:
    """Yield {side: SideChunk} over equal row ranges of every side, checked against the first side; with
    `samples`, only the rows of that range of sample ids (a range with no rows on any side yields nothing).
    expert_ids=False leaves ids >= num_experts to the caller (the doctor names them as routes_invalid);
    logprobs_only reads the keys and log-probs alone (no routing column: a k3 needs none)."""
    streams = [
        _Stream(
            side=side,
            batches=prefetched(
                iter_batches(
                    run.side_dir(side),
                    [*KEY_COLUMNS, "is_response", "logprob"] if logprobs_only else side_columns(run, side, shape),
                    shape,
                    samples,
                )
            ),
        )
        for side in sides
    ]
    while True:
        alive = [s.refill() for s in streams]
        if not any(alive):
            if streams[0].last is None and samples is None:
                raise ProbeError(f"{run.side_dir(sides[0])}: no rows (empty run)")
            return
        if not all(alive):
            _coverage_error(streams, alive)
        n = min(s.remaining() for s in streams)
        chunks = {}
        for s in streams:
            chunks[s.side] = _to_chunk(s.path, s.batch.slice(s.offset, n), shape)
            s.offset += n
            check_chunk_order(chunks[s.side], s.side, s.last)
            s.last = (int(chunks[s.side].sample_id[-1]), int(chunks[s.side].position[-1]))
        validate(chunks, shape, expert_ids)
        yield chunks


def _coverage_error(streams: list[_Stream], alive: list[bool]) -> None:
    short = next(s for s, a in zip(streams, alive) if not a)
    longer = next(s for s, a in zip(streams, alive) if a)
    nxt = longer.batch.slice(longer.offset, 1)
    sample, position = nxt.column("sample_id")[0].as_py(), nxt.column("position")[0].as_py()
    ended = f"after sample {short.last[0]} position {short.last[1]}" if short.last else "with no rows"
    raise ProbeError(
        f"{short.side}: covers fewer samples than {longer.side}: it ends {ended}, "
        f"while {longer.side} ({longer.path.name}) continues with sample {sample} position {position}"
    )


def _where(chunk: SideChunk, side: str, i: int) -> str:
    return f"{side} ({chunk.path.name}) sample {chunk.sample_id[i]} position {chunk.position[i]}"


def check_chunk_order(chunk: SideChunk, side: str, last: tuple[int, int] | None) -> None:
    """Rows sorted by (sample_id, position), positions 0, 1, 2... in each sample, continuing from `last`."""
    s, p = chunk.sample_id, chunk.position
    i = first_unordered_row(s, p, last)
    if i is None:
        return
    before = last if i == 0 else (s[i - 1], p[i - 1])
    after = "as the first row of the side" if before is None else f"after sample {before[0]} position {before[1]}"
    raise ProbeError(
        f"{_where(chunk, side, i)}: row out of order {after} (expected rows sorted by sample_id, position, "
        "with positions 0, 1, 2... in each sample)"
    )


def validate(chunks: dict[str, SideChunk], shape: RoutingShape, expert_ids: bool = True) -> None:
    """Same rows on every side, sane log-probs and (unless expert_ids is False) expert ids; errors name file,
    sample and position."""
    (ref_side, ref), *others = chunks.items()
    for side, chunk in chunks.items():
        _check_logprobs(chunk, side)
        if chunk.experts is not None:
            if expert_ids:
                _check_expert_ids(chunk, side, shape)
            if chunk.experts.dtype != shape.id_dtype:  # uint8 and uint16 are both allowed: compare like with like
                chunk.experts = chunk.experts.astype(shape.id_dtype)
    for side, chunk in others:
        for name in (*KEY_COLUMNS, "is_response"):
            a, b = getattr(ref, name), getattr(chunk, name)
            if not np.array_equal(a, b):
                i = int(np.flatnonzero(a != b)[0])
                raise ProbeError(
                    f"{side} ({chunk.path.name}): {name} {b[i]} at sample {chunk.sample_id[i]} position "
                    f"{chunk.position[i]} differs from {ref_side} ({ref.path.name}) {name} {a[i]} at sample "
                    f"{ref.sample_id[i]} position {ref.position[i]}"
                )


def _check_logprobs(chunk: SideChunk, side: str) -> None:
    bad = (chunk.logprob > MAX_LOGPROB) & chunk.logprob_valid & np.isfinite(chunk.logprob)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ProbeError(
            f"{_where(chunk, side, i)}: logprob {chunk.logprob[i]:.6g} > 0, expected a log-probability <= 0"
        )


def _check_expert_ids(chunk: SideChunk, side: str, shape: RoutingShape) -> None:
    experts = chunk.experts
    if shape.num_experts > np.iinfo(experts.dtype).max or experts.size == 0 or experts.max() < shape.num_experts:
        return  # the common case costs one vectorised max
    bad = (experts >= shape.num_experts).any(axis=(1, 2)) & chunk.experts_valid
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ProbeError(
            f"{_where(chunk, side, i)}: expert id {int(experts[i].max())} >= num_experts {shape.num_experts} "
            f"(from the run manifest); `probe doctor` on the run names the engine bug (routes_invalid)"
        )
