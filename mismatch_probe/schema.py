"""The token table: the one Parquet schema every writer and reader of a run uses (SPEC section 4)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.records import SequenceRecord

# 2: routing columns are nullable variable-size lists (a null row has no ids), which every pyarrow in range
# writes and reads. 1 stored them as nullable fixed-size lists, which only pyarrow >= 26 writes with null
# rows or reads back; format-1 parts stay readable wherever the installed pyarrow can read them.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
FIXED_LIST_PYARROW = 26  # the first pyarrow that reads format 1's null fixed-size list rows
ROUTER_MARGIN = "router_margin"
STEP = "step"  # optional uint32, nullable: the RL step of each row's sample
EXPERT_LOGPROBS = "expert_logprobs"  # optional: the router's log-prob of each listed expert (--router-logprobs)
# optional, a new-policy set's: this forward's router log-prob at each expert its --old set chose (RSPO's shift)
EXPERT_LOGPROBS_AT_OLD = "expert_logprobs_at_old"
# optional float32, nullable: per response token, the log of the probability mass (at the side's temperature) of the
# top-p/top-k support its log-prob is renormalised over, <= 0; written by the engines that know it (the hf
# engines; `probe rescore --sampling rollout`), null elsewhere. processed log-prob = raw log-prob - kept_logmass.
KEPT_LOGMASS = "kept_logmass"
# optional, nullable, one value per sample on each of its rows, where a serving engine says it (SGLang's meta_info,
# vLLM's usage.prompt_tokens_details): the prompt tokens its prefix cache served, and the weights' version
CACHED_TOKENS, WEIGHT_VERSION = "cached_tokens", "weight_version"
SERVING_PATH_COLUMNS: dict[str, pa.DataType] = {CACHED_TOKENS: pa.uint32(), WEIGHT_VERSION: pa.string()}
ROUTING_LIST_COLUMNS = ("experts", EXPERT_LOGPROBS, EXPERT_LOGPROBS_AT_OLD, ROUTER_MARGIN)

BASE_COLUMNS: dict[str, pa.DataType] = {
    "sample_id": pa.uint32(),
    "prompt_id": pa.uint32(),
    "position": pa.uint32(),
    "token_id": pa.uint32(),
    "is_response": pa.bool_(),
    "logprob": pa.float32(),
}
OPTIONAL_SCALAR_COLUMNS: dict[str, pa.DataType] = {
    "top_token_id": pa.uint32(),
    "top_logprob": pa.float32(),
}


@dataclass(frozen=True)
class RoutingShape:
    """Shape of the `experts` column: MoE layers x top-k ids drawn from num_experts."""

    num_layers: int = 0
    top_k: int = 0
    num_experts: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_layers > 0

    @property
    def width(self) -> int:
        """Ids per routed row: num_layers x top_k (format 1 gave a dense model's all-null column width 1)."""
        return max(1, self.num_layers * self.top_k)

    @property
    def id_type(self) -> pa.DataType:
        return pa.uint8() if self.num_experts <= 256 else pa.uint16()

    @property
    def id_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)


def router_margin_type(shape: RoutingShape) -> pa.DataType:
    """Optional column: per MoE layer, the router's k-th minus (k+1)-th largest selection score."""
    return pa.list_(pa.float32())


def token_schema(
    shape: RoutingShape,
    with_top: bool = True,
    with_expert_logprobs: bool = False,
    with_router_margin: bool = False,
    with_step: bool = False,
    with_expert_logprobs_at_old: bool = False,
    with_kept_logmass: bool = False,
    with_serving_path: bool = False,
) -> pa.Schema:
    fields = [pa.field(name, typ, nullable=(name == "logprob")) for name, typ in BASE_COLUMNS.items()]
    fields.append(pa.field("experts", pa.list_(shape.id_type)))
    if with_top:
        fields += [pa.field(name, typ) for name, typ in OPTIONAL_SCALAR_COLUMNS.items()]
    if with_expert_logprobs:
        fields.append(pa.field(EXPERT_LOGPROBS, pa.list_(pa.float32())))
    if with_expert_logprobs_at_old:
        fields.append(pa.field(EXPERT_LOGPROBS_AT_OLD, pa.list_(pa.float32())))
    if with_router_margin and shape.is_moe:
        fields.append(pa.field(ROUTER_MARGIN, router_margin_type(shape)))
    if with_step:
        fields.append(pa.field(STEP, pa.uint32(), nullable=True))
    if with_kept_logmass:
        fields.append(pa.field(KEPT_LOGMASS, pa.float32(), nullable=True))
    if with_serving_path:
        fields += [pa.field(name, typ, nullable=True) for name, typ in SERVING_PATH_COLUMNS.items()]
    return pa.schema(fields, metadata={"mismatch_probe.schema_version": str(SCHEMA_VERSION)})


def routing_list(values: np.ndarray, width: int, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
    """Rows of `width` values where valid, null (and empty) elsewhere."""
    offsets = np.zeros(len(valid) + 1, dtype=np.int32)
    np.cumsum(valid * np.int32(width), out=offsets[1:])
    flat = pa.array(np.ascontiguousarray(values[valid]).reshape(-1), type=typ)
    return pa.ListArray.from_arrays(pa.array(offsets), flat, type=pa.list_(typ), mask=pa.array(~valid))


def records_to_batch(records: list[SequenceRecord], schema: pa.Schema, shape: RoutingShape) -> pa.RecordBatch:
    """Concatenate sequences into one record batch in (sample_id, position) order."""
    records = sorted(records, key=lambda r: r.sample_id)
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    n = int(lengths.sum())
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array(np.repeat([r.sample_id for r in records], lengths).astype(np.uint32)),
        "prompt_id": pa.array(np.repeat([r.prompt_id for r in records], lengths).astype(np.uint32)),
        "position": pa.array(np.concatenate([np.arange(len(r), dtype=np.uint32) for r in records])),
        "token_id": pa.array(np.concatenate([r.token_ids for r in records]).astype(np.uint32)),
        "is_response": pa.array(np.concatenate([np.arange(len(r)) >= r.prompt_len for r in records])),
    }
    logprob_valid = np.concatenate([r.logprob_valid for r in records])
    cols["logprob"] = pa.array(np.concatenate([r.logprob for r in records]).astype(np.float32), mask=~logprob_valid)

    experts_valid = np.zeros(n, dtype=bool)
    experts = np.zeros((n, shape.width), dtype=shape.id_dtype)
    expert_logprobs = np.zeros((n, shape.width), dtype=np.float32)
    at_old = np.zeros((n, shape.width), dtype=np.float32)
    if shape.is_moe:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for r, start, stop in zip(records, offsets[:-1], offsets[1:]):
            if r.experts is None:
                continue
            if r.experts.shape[1:] != (shape.num_layers, shape.top_k):
                raise ProbeError(
                    f"sample {r.sample_id}: routing shape {tuple(r.experts.shape[1:])} does not match "
                    f"the manifest's (num_layers={shape.num_layers}, top_k={shape.top_k})"
                )
            experts_valid[start:stop] = r.experts_valid
            experts[start:stop] = r.experts.reshape(len(r), -1)
            if r.expert_logprobs is not None:
                expert_logprobs[start:stop] = r.expert_logprobs.reshape(len(r), -1)
            if r.expert_logprobs_at_old is not None:
                at_old[start:stop] = r.expert_logprobs_at_old.reshape(len(r), -1)
    cols["experts"] = routing_list(experts, shape.width, experts_valid, shape.id_type)

    if "top_token_id" in schema.names:
        top_ids = np.concatenate([_or_zeros(r.top_token_id, len(r), np.uint32) for r in records])
        top_lp = np.concatenate([_or_zeros(r.top_logprob, len(r), np.float32) for r in records])
        top_valid = logprob_valid & np.concatenate([np.full(len(r), r.top_token_id is not None) for r in records])
        cols["top_token_id"] = pa.array(top_ids.astype(np.uint32), mask=~top_valid)
        cols["top_logprob"] = pa.array(top_lp.astype(np.float32), mask=~top_valid)
    if EXPERT_LOGPROBS in schema.names:
        cols[EXPERT_LOGPROBS] = routing_list(expert_logprobs, shape.width, experts_valid, pa.float32())
    if EXPERT_LOGPROBS_AT_OLD in schema.names:
        cols[EXPERT_LOGPROBS_AT_OLD] = routing_list(at_old, shape.width, experts_valid, pa.float32())
    if ROUTER_MARGIN in schema.names:
        cols[ROUTER_MARGIN] = _router_margin(records, shape, n)
    if STEP in schema.names:  # null for a sample recorded without a step
        steps = np.array([-1 if r.step is None else r.step for r in records], dtype=np.int64)
        per_row = np.repeat(steps, lengths)
        cols[STEP] = pa.array(np.maximum(per_row, 0).astype(np.uint32), mask=per_row < 0)
    if KEPT_LOGMASS in schema.names:
        cols[KEPT_LOGMASS] = _kept_logmass(records)
    if CACHED_TOKENS in schema.names:  # null for a sample whose engine did not say
        cached = np.array([-1 if r.cached_tokens is None else r.cached_tokens for r in records], dtype=np.int64)
        per_row = np.repeat(cached, lengths)
        cols[CACHED_TOKENS] = pa.array(np.maximum(per_row, 0).astype(np.uint32), mask=per_row < 0)
    if WEIGHT_VERSION in schema.names:
        versions = pa.array([r.weight_version for r in records], type=pa.string())
        cols[WEIGHT_VERSION] = versions.take(pa.array(np.repeat(np.arange(len(records)), lengths)))
    return pa.RecordBatch.from_arrays([cols[name] for name in schema.names], schema=schema)


def _kept_logmass(records: list[SequenceRecord]) -> pa.Array:
    """Known at scored positions (from max(prompt_len, 1) on) of records that carry it, where finite; null elsewhere."""
    values = np.concatenate([_or_zeros(r.kept_logmass, len(r), np.float32) for r in records]).astype(np.float32)
    known = np.concatenate(
        [(np.arange(len(r)) >= max(r.prompt_len, 1)) & (r.kept_logmass is not None) for r in records]
    ) & np.isfinite(values)
    return pa.array(np.where(known, values, 0).astype(np.float32), mask=~known)


def _router_margin(records: list[SequenceRecord], shape: RoutingShape, n: int) -> pa.Array:
    """Null where a record has no margins or no routing at that position."""
    margins = np.zeros((n, shape.num_layers), dtype=np.float32)
    valid = np.zeros(n, dtype=bool)
    start = 0
    for r in records:
        if r.router_margin is not None and r.experts_valid is not None:
            margins[start : start + len(r)] = r.router_margin
            valid[start : start + len(r)] = r.experts_valid
        start += len(r)
    return routing_list(margins, shape.num_layers, valid, pa.float32())


def _or_zeros(values: np.ndarray | None, n: int, dtype) -> np.ndarray:
    return np.zeros(n, dtype=dtype) if values is None else values


def _is_routing_list(typ: pa.DataType) -> bool:
    """Format 2's variable-size list, or format 1's fixed-size one (read where pyarrow can)."""
    return pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ)


def check_schema(schema: pa.Schema, where: str, shape: RoutingShape | None = None) -> None:
    """Raise a one-line ProbeError naming `where` and the first column that breaks the contract."""
    for name, typ in BASE_COLUMNS.items():
        if name not in schema.names:
            raise ProbeError(f"{where}: missing column '{name}' (expected {typ})")
        if schema.field(name).type != typ:
            raise ProbeError(f"{where}: column '{name}' has type {schema.field(name).type}, expected {typ}")
    if "experts" not in schema.names:
        raise ProbeError(f"{where}: missing column 'experts' (expected list<uint8|uint16>)")
    experts_type = schema.field("experts").type
    if not _is_routing_list(experts_type) or experts_type.value_type not in (pa.uint8(), pa.uint16()):
        raise ProbeError(f"{where}: column 'experts' has type {experts_type}, expected list<uint8|uint16>")
    if shape is not None and pa.types.is_fixed_size_list(experts_type) and experts_type.list_size != shape.width:
        raise ProbeError(
            f"{where}: column 'experts' has width {experts_type.list_size}, but the manifest says "
            f"num_layers x top_k = {shape.num_layers} x {shape.top_k} = {shape.width}"
        )
    for name, typ in OPTIONAL_SCALAR_COLUMNS.items():
        if name in schema.names and schema.field(name).type != typ:
            raise ProbeError(f"{where}: column '{name}' has type {schema.field(name).type}, expected {typ}")
    if ROUTER_MARGIN in schema.names:
        _check_router_margin(schema.field(ROUTER_MARGIN).type, where, shape)
    if STEP in schema.names and schema.field(STEP).type != pa.uint32():
        raise ProbeError(f"{where}: column '{STEP}' has type {schema.field(STEP).type}, expected uint32")
    for name, typ in SERVING_PATH_COLUMNS.items():
        if name in schema.names and schema.field(name).type != typ:
            raise ProbeError(f"{where}: column '{name}' has type {schema.field(name).type}, expected {typ}")
    if KEPT_LOGMASS in schema.names and schema.field(KEPT_LOGMASS).type != pa.float32():
        raise ProbeError(
            f"{where}: column '{KEPT_LOGMASS}' has type {schema.field(KEPT_LOGMASS).type}, expected float32"
        )


def _check_router_margin(typ: pa.DataType, where: str, shape: RoutingShape | None) -> None:
    if not _is_routing_list(typ) or typ.value_type != pa.float32():
        raise ProbeError(f"{where}: column '{ROUTER_MARGIN}' has type {typ}, expected list<float32>")
    if shape is not None and pa.types.is_fixed_size_list(typ) and typ.list_size != shape.num_layers:
        raise ProbeError(
            f"{where}: column '{ROUTER_MARGIN}' has width {typ.list_size}, but the manifest says "
            f"num_layers = {shape.num_layers}"
        )


def experts_matrix(
    column: pa.Array | pa.ChunkedArray, shape: RoutingShape, where: str = "experts"
) -> tuple[np.ndarray, np.ndarray]:
    """`[n, layers, k]` ids plus a row validity mask (a view where no row is null)."""
    flat, valid = routing_matrix(column, shape.width, f"{where}: column 'experts'")
    return flat.reshape(len(flat), shape.num_layers, shape.top_k), valid


def routing_matrix(column: pa.Array | pa.ChunkedArray, width: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A routing list column as `[n, width]` values plus a row validity mask; rows that are null hold zeros.

    Format 2 (variable-size lists) must hold exactly `width` values in every non-null row: anything else
    is a ProbeError naming `where` and the row. Format 1 (fixed-size lists) is read as it is stored."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        return fixed_list_matrix(column)
    n = len(column)
    valid = np.ones(n, dtype=bool) if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()  # n + 1 offsets into `values`, this slice's own
    lengths = np.diff(offsets)
    bad = np.flatnonzero(lengths != np.where(valid, width, lengths))
    if bad.size:
        raise ProbeError(f"{where}: row {bad[0]} holds {lengths[bad[0]]} values, expected {width}")
    values = _buffer_values(column.values)
    if not (lengths[~valid] == 0).all():  # another writer left values under null rows: gather the valid ones
        out = np.zeros((n, width), dtype=values.dtype)
        out[valid] = values[offsets[:-1][valid, None] + np.arange(width)]
        return out, valid
    if width == 0:
        return np.zeros((n, 0), dtype=values.dtype), valid
    # As probe writes it, null rows are empty: the child values are the valid rows' matrix, in order.
    block = values[offsets[0] : offsets[-1]].reshape(-1, width)
    if valid.all():
        return block, valid  # every row routed: a view, no copy
    out = np.zeros((n, width), dtype=values.dtype)
    out[valid] = block
    return out, valid


def numpy_dtype(typ: pa.DataType) -> np.dtype:
    """The numpy dtype of a primitive Arrow type (pyarrow < 26's `to_pandas_dtype` imports pandas)."""
    return pa.array([], type=typ).to_numpy(zero_copy_only=False).dtype


def _buffer_values(values: pa.Array) -> np.ndarray:
    # The data buffer directly: nulls inside the child (none in format 2) would turn to_numpy into floats.
    dtype = numpy_dtype(values.type)
    data = values.buffers()[1]
    if data is None:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=values.offset + len(values))[values.offset :]


def fixed_list_matrix(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy view of a format-1 fixed-size list column as `[n, width]` values plus a row validity mask."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    valid = np.ones(n, dtype=bool) if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False)
    width = column.type.list_size
    # A fixed-size list stores width child values for every slot, null or not, so slicing is exact.
    values = column.values
    dtype = numpy_dtype(values.type)
    start = values.offset + column.offset * width
    flat = np.frombuffer(values.buffers()[1], dtype=dtype, count=start + n * width)[start:]
    return flat.reshape(n, width), valid


def unreadable_format_1(exc: BaseException) -> bool:
    """True for the errors pyarrow < 26 raises on format 1's fixed-size list columns with null rows."""
    text = str(exc)
    return "Expected all lists to be of size" in text or "non-zero length null components" in text


def format_1_message(where: str) -> str:
    return (
        f"{where}: written in run format 1 (routing as fixed-size lists with null rows), which pyarrow "
        f"{pa.__version__} cannot read; it needs pyarrow >= {FIXED_LIST_PYARROW} (pip install "
        f"'pyarrow>={FIXED_LIST_PYARROW}'), or write the run again with this probe (format {SCHEMA_VERSION})"
    )
