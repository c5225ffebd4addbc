"""The token table round-trips through our writer and opens in polars and pyarrow with the spec's types."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.parts import completed_sample_ids, iter_batches, iter_score_requests, write_part
from mismatch_probe.rundir.records import SequenceRecord
from mismatch_probe.schema import RoutingShape, check_schema, experts_matrix, routing_matrix, token_schema

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

SHAPE = RoutingShape(num_layers=3, top_k=2, num_experts=8)


def _record(sample_id: int, n: int, prompt_len: int, rng) -> SequenceRecord:
    valid = np.arange(n) >= prompt_len
    return SequenceRecord(
        sample_id=sample_id,
        prompt_id=sample_id // 2,
        token_ids=rng.integers(0, 1000, n),
        prompt_len=prompt_len,
        logprob=np.where(valid, -rng.random(n), 0).astype(np.float32),
        logprob_valid=valid,
        top_token_id=rng.integers(0, 1000, n),
        top_logprob=-rng.random(n).astype(np.float32),
        experts=rng.integers(0, 8, (n, 3, 2)),
        experts_valid=np.arange(n) < n - 1,
    )


def test_round_trip_types_and_values(tmp_path):
    rng = np.random.default_rng(0)
    records = [_record(i, 5 + i, 3, rng) for i in (2, 0, 1)]  # written out of order on purpose
    write_part(tmp_path, records, token_schema(SHAPE), SHAPE)

    frame = pl.read_parquet(tmp_path)
    assert frame.schema == pl.Schema(
        {
            "sample_id": pl.UInt32,
            "prompt_id": pl.UInt32,
            "position": pl.UInt32,
            "token_id": pl.UInt32,
            "is_response": pl.Boolean,
            "logprob": pl.Float32,
            "experts": pl.List(pl.UInt8),
            "top_token_id": pl.UInt32,
            "top_logprob": pl.Float32,
        }
    )
    assert frame["sample_id"].to_list() == [0] * 5 + [1] * 6 + [2] * 7
    assert frame["position"].to_list() == list(range(5)) + list(range(6)) + list(range(7))

    table = pq.read_table(tmp_path)
    check_schema(table.schema, "t", SHAPE)
    by_id = {r.sample_id: r for r in records}
    experts, valid = experts_matrix(table.column("experts"), SHAPE)
    offset = 0
    for sid in (0, 1, 2):
        r, n = by_id[sid], len(by_id[sid])
        rows = slice(offset, offset + n)
        np.testing.assert_array_equal(table.column("token_id").to_numpy()[rows], r.token_ids)
        lp = table.column("logprob").to_pylist()[offset : offset + n]
        assert lp[:3] == [None] * 3  # prompt tokens carry no log-prob
        np.testing.assert_allclose(lp[3:], r.logprob[3:], rtol=0, atol=0)
        np.testing.assert_array_equal(valid[rows], r.experts_valid)
        np.testing.assert_array_equal(experts[rows][r.experts_valid], r.experts[r.experts_valid])
        # layer-major: layer 0's k ids, then layer 1's
        assert frame["experts"][offset + 0].to_list() == r.experts[0].reshape(-1).tolist()
        assert frame["experts"][offset + n - 1] is None  # no routing for the last token: a null row
        offset += n


def test_row_groups_end_at_sequence_boundaries(tmp_path, monkeypatch):
    import mismatch_probe.rundir.parts as table_io

    monkeypatch.setattr(table_io, "ROW_GROUP_ROWS", 10)
    rng = np.random.default_rng(1)
    path = write_part(tmp_path, [_record(i, 6, 2, rng) for i in range(5)], token_schema(SHAPE), SHAPE)
    handle = pq.ParquetFile(path)
    assert handle.num_row_groups == 5
    for i in range(handle.num_row_groups):
        ids = handle.read_row_group(i, columns=["sample_id"]).column(0).to_numpy()
        assert len(set(ids.tolist())) == 1


def test_uint16_ids_when_more_than_256_experts():
    shape = RoutingShape(2, 8, 300)
    assert token_schema(shape).field("experts").type == pa.list_(pa.uint16())
    assert token_schema(RoutingShape(2, 8, 256)).field("experts").type == pa.list_(pa.uint8())


def test_split_into_score_requests_and_completed_ids(tmp_path):
    rng = np.random.default_rng(2)
    records = [_record(i, 4 + i, 2, rng) for i in range(4)]
    write_part(tmp_path, records, token_schema(SHAPE), SHAPE)
    [(name, requests)] = list(iter_score_requests(tmp_path, SHAPE, with_experts=True))
    assert name == "part-0000000000.parquet"
    assert [r.sample_id for r in requests] == [0, 1, 2, 3]
    for req, rec in zip(requests, records):
        np.testing.assert_array_equal(req.token_ids, rec.token_ids)
        assert req.prompt_len == 2
        np.testing.assert_array_equal(req.replay_valid, rec.experts_valid)
    assert completed_sample_ids(tmp_path).tolist() == [0, 1, 2, 3]
    assert sum(b.num_rows for _, b in iter_batches(tmp_path, ["sample_id"])) == sum(len(r) for r in records)


def test_schema_check_names_the_column():
    schema = token_schema(SHAPE)
    bad = schema.set(schema.get_field_index("logprob"), pa.field("logprob", pa.float64()))
    with pytest.raises(ProbeError, match=r"^x.parquet: column 'logprob' has type double, expected float$"):
        check_schema(bad, "x.parquet", SHAPE)
    with pytest.raises(ProbeError, match=r"missing column 'token_id'"):
        check_schema(schema.remove(schema.get_field_index("token_id")), "x.parquet")
    old = schema.set(schema.get_field_index("experts"), pa.field("experts", pa.list_(pa.uint8(), 6)))
    with pytest.raises(ProbeError, match=r"width 6, but the manifest says num_layers x top_k = 4 x 2 = 8"):
        check_schema(old, "x.parquet", RoutingShape(4, 2, 8))  # format 1: the width is in the type


def test_rows_of_the_wrong_width_are_named(tmp_path):
    """Format 2 carries the width in the data: a part of 3 x 2 ids read as a 4 x 2 model names the row."""
    rng = np.random.default_rng(3)
    write_part(tmp_path, [_record(0, 5, 2, rng)], token_schema(SHAPE), SHAPE)
    wide = RoutingShape(4, 2, 8)
    with pytest.raises(
        ProbeError, match=r"part-0000000000.parquet: column 'experts': row 0 holds 6 values, expected 8$"
    ):
        list(iter_score_requests(tmp_path, wide, with_experts=True))


@pytest.mark.parametrize("width", [1, 6])
def test_routing_matrix_equals_a_row_by_row_reading(width):
    """Known answer: the vectorised reading equals a naive per-row one, nulls, slices and chunks included."""
    rng = np.random.default_rng(width)
    rows = [None if rng.random() < 0.3 else rng.integers(0, 200, width).tolist() for _ in range(50)]
    column = pa.array(rows, type=pa.list_(pa.uint8()))
    for piece in (column, column.slice(7, 30), pa.chunked_array([column.slice(0, 20), column.slice(20)])):
        values, valid = routing_matrix(piece, width, "t")
        expected = piece.to_pylist()
        assert valid.tolist() == [row is not None for row in expected]
        assert values.tolist() == [row if row is not None else [0] * width for row in expected]


def test_a_null_row_with_values_under_it_reads_as_unrouted():
    # Arrow lets a null list slot cover child values; they are not routing.
    column = pa.ListArray.from_arrays(
        pa.array([0, 2, 4, 6], pa.int32()),
        pa.array([1, 2, 3, 4, 5, 6], pa.uint8()),
        mask=pa.array([False, True, False]),
    )
    values, valid = routing_matrix(column, 2, "t")
    assert valid.tolist() == [True, False, True] and values.tolist() == [[1, 2], [0, 0], [5, 6]]


def test_every_routing_column_is_a_plain_nullable_list(tmp_path):
    """The format that every pyarrow in range writes and reads: no fixed-size list anywhere."""
    schema = token_schema(SHAPE, with_expert_logprobs=True, with_router_margin=True)
    for name in ("experts", "expert_logprobs", "router_margin"):
        assert pa.types.is_list(schema.field(name).type), name
    assert schema.metadata[b"mismatch_probe.schema_version"] == b"2"
