"""Comparisons fed from plain arrays, for known-answer tests of the accumulators: real SideChunks through
the report's own FrameBuilder and Comparison, no Parquet in between."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from mismatch_probe.frames.align import SideChunk
from mismatch_probe.frames.pair_frame import FrameBuilder
from mismatch_probe.report.keys.levels import DEFAULT_GEO_BOUNDS, DEFAULT_THRESHOLDS, DEFAULT_TIS_CAPS
from mismatch_probe.report.keys.request import ReportRequest
from mismatch_probe.report.stream.comparison import Comparison
from mismatch_probe.schema import RoutingShape, routing_list, routing_matrix

DENSE = RoutingShape(num_layers=0, top_k=0, num_experts=0)
ROW_FIELDS = (
    "sample_id",
    "position",
    "token_id",
    "is_response",
    "logprob",
    "logprob_valid",
    "experts",
    "experts_valid",
)


def side_chunk(
    sample_id, logprob, *, is_response=None, valid=None, top=None, experts=None, experts_valid=None, router_margin=None
) -> SideChunk:
    """One side's rows; positions count 0, 1, 2... within each sample, and everything is a response by default."""
    sample_id = np.asarray(sample_id, dtype=np.uint32)
    n = len(sample_id)
    starts = np.flatnonzero(np.r_[True, sample_id[1:] != sample_id[:-1]])
    position = (np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))).astype(np.uint32)
    return SideChunk(
        path=Path("arrays.parquet"),
        sample_id=sample_id,
        position=position,
        token_id=np.zeros(n, dtype=np.uint32),
        is_response=np.ones(n, bool) if is_response is None else np.asarray(is_response, bool),
        logprob=np.asarray(logprob, dtype=np.float32),
        logprob_valid=np.ones(n, bool) if valid is None else np.asarray(valid, bool),
        top=None if top is None else (np.asarray(top[0], np.uint32), np.asarray(top[1], bool)),
        experts=None if experts is None else np.asarray(experts),
        experts_valid=None
        if experts is None
        else (np.ones(n, bool) if experts_valid is None else np.asarray(experts_valid, bool)),
        router_margin=router_margin,
    )


def cut(chunk: SideChunk, cuts) -> list[SideChunk]:
    """The chunk's rows split at the row indices `cuts` (sequences are cut too)."""
    bounds = [0, *cuts, len(chunk.sample_id)]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        piece = SideChunk(
            path=chunk.path,
            **{name: getattr(chunk, name)[a:b] if getattr(chunk, name) is not None else None for name in ROW_FIELDS},
        )
        piece.top = None if chunk.top is None else (chunk.top[0][a:b], chunk.top[1][a:b])
        piece.router_margin = (
            None if chunk.router_margin is None else (chunk.router_margin[0][a:b], chunk.router_margin[1][a:b])
        )
        pieces.append(piece)
    return pieces


def compare(
    ref: list[SideChunk],
    cand: list[SideChunk],
    shape: RoutingShape = DENSE,
    routing_scope: str = "all",
    thresholds=DEFAULT_THRESHOLDS,
    tis_caps=DEFAULT_TIS_CAPS,
    geo_bounds=DEFAULT_GEO_BOUNDS,
    worst: int = 0,
) -> Comparison:
    """A finished comparison of the aligned chunks `ref[i]`, `cand[i]`."""
    request = ReportRequest(thresholds=thresholds, tis_caps=tis_caps, geo_bounds=geo_bounds, worst=worst)
    comp = Comparison.new("ref", "cand", shape, request)
    builder = FrameBuilder(shape, routing_scope)
    for r, c in zip(ref, cand, strict=True):
        (frame,) = builder.frames({"ref": r, "cand": c}, [comp.sides], [comp.row_functions()])
        comp.update(frame)
    comp.finish()
    return comp


def metrics(ref: list[SideChunk], cand: list[SideChunk], **kwargs) -> dict:
    return compare(ref, cand, **kwargs).to_json("all")["metrics"]


def assert_close(got, want, rel: float = 1e-12, path: str = "") -> None:
    """JSON-like values equal: the same keys, lengths, types and None-ness; ints and strings exactly, floats
    to `rel` relative."""
    assert type(got) is type(want), (path, got, want)
    if isinstance(want, dict):
        assert list(got) == list(want), (path, set(got) ^ set(want))
        for key in want:
            assert_close(got[key], want[key], rel, f"{path}/{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), (path, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, rel, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == want or abs(got - want) <= rel * max(abs(got), abs(want)), (path, got, want)
    else:
        assert got == want, (path, got, want)


def with_null_rows(column: pa.Array, mask: np.ndarray) -> pa.Array:
    """`column` with the rows under `mask` made null as a writer would make them (a routing list row: empty)."""
    if pa.types.is_list(column.type):
        lengths = np.diff(column.offsets.to_numpy())
        width = int(lengths[column.is_valid().to_numpy(zero_copy_only=False)].max(initial=0))
        values, valid = routing_matrix(column, width, "column")
        return routing_list(values, width, valid & ~mask, column.type.value_type)
    return pa.array(column.to_numpy(zero_copy_only=False), type=column.type, mask=mask)


def with_empty_null_lists(table: pa.Table) -> pa.Table:
    """Routing list rows that are null made empty, as probe writes them. A table that went through polars may
    keep values under null rows, which pyarrow before 26 refuses to write ("Lists with non-zero length null
    components are not supported")."""
    for i, field in enumerate(table.schema):
        if pa.types.is_list(field.type):
            column = table.column(i).combine_chunks()
            table = table.set_column(i, field, with_null_rows(column, np.zeros(len(column), dtype=bool)))
    return table
