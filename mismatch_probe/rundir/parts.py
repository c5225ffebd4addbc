"""Streaming, atomic reads and writes of a side's token table (a folder of part files).

A side is `part-<first sample id>.parquet` files; each covers a contiguous, increasing range of
sample ids, so reading the parts in name order yields rows in (sample_id, position) order.
A part is written under a hidden temporary name and renamed when complete, so a crash never
leaves a file a reader would take for finished.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.errors import ProbeError, first_line
from mismatch_probe.rundir.location import arrow_open
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord
from mismatch_probe.schema import (
    RoutingShape,
    check_schema,
    experts_matrix,
    format_1_message,
    records_to_batch,
    unreadable_format_1,
)

ROW_GROUP_ROWS = 1 << 17
BATCH_ROWS = 1 << 14  # rows per decoded batch when streaming a side
PART_GLOB = "part-*.parquet"


def part_name(first_sample_id: int) -> str:
    return f"part-{first_sample_id:010d}.parquet"


def write_part(directory: Path, records: list[SequenceRecord], schema: pa.Schema, shape: RoutingShape) -> Path:
    """Write sequences as one part file; row groups end at sequence boundaries."""
    records = sorted(records, key=lambda r: r.sample_id)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / part_name(records[0].sample_id)
    tmp = directory / f".{final.name}.tmp"
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for group in _row_groups(records):
                batch = records_to_batch(group, schema, shape)
                writer.write_table(pa.Table.from_batches([batch]), row_group_size=batch.num_rows)
        with open(tmp, "rb") as fh:  # on disk before the rename, so a power cut cannot leave an empty "finished" part
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write token table ({exc.strerror or exc})") from exc
    return final


def _row_groups(records: list[SequenceRecord]) -> Iterator[list[SequenceRecord]]:
    group: list[SequenceRecord] = []
    rows = 0
    for record in records:
        if group and rows + len(record) > ROW_GROUP_ROWS:
            yield group
            group, rows = [], 0
        group.append(record)
        rows += len(record)
    if group:
        yield group


def part_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(PART_GLOB), key=lambda path: path.name)


def require_parts(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ProbeError(f"{directory}: token table folder not found")
    parts = part_files(directory)
    if not parts:
        raise ProbeError(f"{directory}: no part-*.parquet files (empty or unfinished run)")
    return parts


# Every pyarrow failure while reading a part (truncated file, bad page, bad footer...) is bad input.
READ_ERRORS = (pa.ArrowException, OSError)


def read_error(where: str, exc: BaseException) -> ProbeError:
    """A part that cannot be decoded: corrupt, or a format-1 part this pyarrow cannot read."""
    if unreadable_format_1(exc):
        return ProbeError(format_1_message(where))
    return ProbeError(f"{where}: corrupt Parquet data ({first_line(exc)})")


def open_part(path: Path, shape: RoutingShape | None = None) -> pq.ParquetFile:
    try:
        handle = pq.ParquetFile(**arrow_open(path))
    except READ_ERRORS as exc:
        raise ProbeError(f"{path}: not a readable Parquet file ({first_line(exc)})") from exc
    check_schema(handle.schema_arrow, str(path), shape)
    return handle


def read_part(path: Path, columns: list[str], shape: RoutingShape | None = None) -> pa.Table:
    """A whole part, only `columns`; a corrupt file is a ProbeError naming it."""
    handle = open_part(path, shape)
    _require_columns(handle, path, columns)
    try:
        return handle.read(columns=columns)
    except READ_ERRORS as exc:
        raise read_error(str(path), exc) from exc


def _require_columns(handle: pq.ParquetFile, path: Path, columns: list[str]) -> None:
    # pyarrow silently skips unknown column names; optional columns must then be in every part of a side.
    missing = [name for name in columns if name not in handle.schema_arrow.names]
    if missing:
        raise ProbeError(f"{path}: missing column '{missing[0]}' (other parts of this side have it)")


def require_no_nulls(path: Path, table: pa.Table | pa.RecordBatch, columns) -> None:
    """Key columns must be fully valid: a null's slot holds arbitrary bytes that would be read as data."""
    for name in columns:
        nulls = table.column(name).null_count
        if nulls:
            raise ProbeError(f"{path}: column '{name}' has {nulls} null values, expected none")


def completed_sample_ids(directory: Path) -> np.ndarray:
    """Sample ids present in finished part files (temporary files are ignored)."""
    ids = [read_part(p, ["sample_id"]).column(0).to_numpy() for p in part_files(directory)]
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, dtype=np.uint32)


def remove_unfinished(directory: Path) -> None:
    for tmp in directory.glob(".part-*.tmp"):
        tmp.unlink()


SampleRange = tuple[int, "int | None"]  # [first sample id, end sample id) of a range of a side; None: to the end


def row_group_samples(handle: pq.ParquetFile) -> list[tuple[int, int, int] | None]:
    """(smallest sample id, largest, rows) of each row group from the footer's statistics; None where the
    writer left no statistics."""
    names = handle.metadata.schema.names
    if "sample_id" not in names:
        return [None] * handle.num_row_groups
    column = names.index("sample_id")
    groups = []
    for i in range(handle.num_row_groups):
        group = handle.metadata.row_group(i)
        stats = group.column(column).statistics
        groups.append((int(stats.min), int(stats.max), group.num_rows) if stats and stats.has_min_max else None)
    return groups


def iter_batches(
    directory: Path, columns: list[str], shape: RoutingShape | None = None, samples: SampleRange | None = None
) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """Stream one side row group by row group, only the columns asked for; with `samples`, only the rows of
    those sample ids (row groups whose statistics lie outside are not read)."""
    for path in require_parts(directory):
        handle = open_part(path, shape)
        _require_columns(handle, path, columns)
        groups = row_group_samples(handle) if samples else []
        for i in range(handle.num_row_groups):
            if samples and groups[i] and not _overlaps(groups[i], samples):
                continue
            # Slices of a row group rather than all of it: the nested `experts` column decodes through
            # per-value level buffers, and small slices keep those in cache and memory flat.
            batches = handle.iter_batches(BATCH_ROWS, row_groups=[i], columns=columns, use_threads=False)
            while True:
                try:
                    batch = next(batches, None)
                except READ_ERRORS as exc:
                    raise read_error(f"{path}: row group {i}", exc) from exc
                if batch is None:
                    break
                if samples:
                    batch = _within(path, i, batch, samples)
                if batch.num_rows:
                    yield path, batch


def _overlaps(group: tuple[int, int, int], samples: SampleRange) -> bool:
    first, end = samples
    return group[1] >= first and (end is None or group[0] < end)


def _within(path: Path, group: int, batch: pa.RecordBatch, samples: SampleRange) -> pa.RecordBatch:
    """The batch's rows whose sample id is in the range. A batch wholly inside is passed on as it is (its
    order is checked downstream); one cut at the range's edge must be sorted, or the cut would hide the
    rows out of order from that check."""
    require_no_nulls(path, batch, ("sample_id",))
    ids = batch.column("sample_id").to_numpy()
    first, end = samples
    if ids[0] >= first and (end is None or ids[-1] < end) and (len(ids) < 2 or ids[0] <= ids[-1]):
        return batch
    down = np.flatnonzero(ids[1:] < ids[:-1])
    if down.size:
        j = int(down[0]) + 1
        raise ProbeError(
            f"{path}: row group {group}: sample_id {ids[j]} after {ids[j - 1]} (rows must be sorted by sample_id, position)"
        )
    start, stop = np.searchsorted(ids, first), len(ids) if end is None else np.searchsorted(ids, end)
    return batch.slice(int(start), int(stop - start))


def iter_score_requests(
    directory: Path, shape: RoutingShape, with_experts: bool
) -> Iterator[tuple[str, list[ScoreRequest]]]:
    """Yield (part name, sequences) for each rollout part, split at sample boundaries without a Python row loop."""
    columns = ["sample_id", "prompt_id", "position", "token_id", "is_response"] + (["experts"] if with_experts else [])
    for path in require_parts(directory):
        table = read_part(path, columns, shape)
        if table.num_rows == 0:
            raise ProbeError(f"{path}: no rows (expected at least one sequence per part file)")
        require_no_nulls(path, table, columns[:5])
        yield path.name, list(_split_sequences(table, shape, with_experts, path))


def first_unordered_row(sample: np.ndarray, position: np.ndarray, last: tuple[int, int] | None = None) -> int | None:
    """Index of the first row breaking (sample_id, position) order with positions 0, 1, 2... in each
    sample, continuing from the `last` (sample, position) seen before these rows; None when all hold."""
    new = sample[1:] != sample[:-1]
    # Within a sample the position steps by 1 (uint32 wrap-around makes any other step != 1);
    # a new sample has a larger id and starts at 0.
    bad = np.where(new, (sample[1:] < sample[:-1]) | (position[1:] != 0), (position[1:] - position[:-1]) != 1)
    if last is None:
        first_ok = position[0] == 0
    elif sample[0] == last[0]:
        first_ok = int(position[0]) == last[1] + 1
    else:
        first_ok = sample[0] > last[0] and position[0] == 0
    if not first_ok:
        return 0
    return int(np.argmax(bad)) + 1 if bad.any() else None


def check_part_order(path: Path, sample: np.ndarray, position: np.ndarray) -> None:
    """Rows must run in (sample_id, position) order with positions 0, 1, 2... inside each sample."""
    i = first_unordered_row(sample, position)
    if i is None:
        return
    expected = position[i - 1] + 1 if i > 0 and sample[i] == sample[i - 1] else 0
    if position[i] == expected:
        raise ProbeError(
            f"{path}: row {i}: sample_id {sample[i]} out of order (rows must be sorted by sample_id, position)"
        )
    raise ProbeError(
        f"{path}: row {i}: sample {sample[i]} has position {position[i]}, expected {expected} "
        "(rows must be sorted by sample_id, position, with no gaps)"
    )


def _split_sequences(table: pa.Table, shape: RoutingShape, with_experts: bool, path: Path) -> Iterable[ScoreRequest]:
    sample = table.column("sample_id").to_numpy()
    prompt = table.column("prompt_id").to_numpy()
    tokens = table.column("token_id").to_numpy()
    response = table.column("is_response").to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, sample[1:] != sample[:-1]])
    stops = np.r_[starts[1:], len(sample)]
    check_part_order(path, sample, table.column("position").to_numpy())
    if with_experts:
        experts, valid = experts_matrix(table.column("experts"), shape, str(path))
        bad = np.flatnonzero(valid & (experts >= shape.num_experts).any(axis=(1, 2)))
        if bad.size:
            raise ProbeError(
                f"{path}: column 'experts': sample {sample[bad[0]]} has an expert id >= num_experts ({shape.num_experts})"
            )
    for start, stop in zip(starts, stops):
        resp = response[start:stop]
        prompt_len = int(np.argmax(resp)) if resp.any() else stop - start
        if resp[prompt_len:].size and not resp[prompt_len:].all():
            raise ProbeError(f"{path}: sample {sample[start]}: is_response is not false-then-true")
        yield ScoreRequest(
            sample_id=int(sample[start]),
            prompt_id=int(prompt[start]),
            token_ids=tokens[start:stop].astype(np.int64),
            prompt_len=prompt_len,
            replay_experts=experts[start:stop] if with_experts else None,
            replay_valid=valid[start:stop] if with_experts else None,
        )
