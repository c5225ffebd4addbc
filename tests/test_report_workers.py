"""`probe report --workers N` and `--ray local`: the run cut into sample-id ranges scanned by other processes
(or Ray tasks) and merged gives the metrics.json of one in-process pass: counts exactly, floats to 1e-12
relative, the same bootstrap intervals and worst tokens. The run has several parts, several row groups per
part, and score sets whose row groups are cut elsewhere than the rollout's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from frames import assert_close

from mismatch_probe.errors import ProbeError, WorkerLost
from mismatch_probe.report.build import build_report
from mismatch_probe.report.stream import plan, ray_tasks, workers
from mismatch_probe.report.stream.plan import plan_units
from mismatch_probe.report.stream.ray_tasks import LOCAL, ray_session
from mismatch_probe.report.stream.scan import scan_unit
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import iter_batches
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

SPEC = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=12,
    n_samples=60,
    prompt_len=(2, 6),
    response_len=(3, 40),
    seed=11,
    router_margin=True,
    samples_per_part=25,
    score_sets=(
        ScoreSetSpec("bf16", logprob_sigma=0.3, route_fraction=0.2, nonfinite_fraction=0.05),
        ScoreSetSpec("fp32", logprob_sigma=0.01, route_fraction=0.01, dtype="fp32"),
    ),
)
ROW_GROUP_ROWS = {"rollout": 97, "scores/bf16": 29, "scores/fp32": 200}  # cut sequences, and each other


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("workers") / "run", SPEC)
    for side, rows in ROW_GROUP_ROWS.items():
        for path in sorted((root / side).glob("part-*.parquet")):
            pq.write_table(pq.read_table(path), path, row_group_size=rows)
    return Run(root)


@pytest.fixture
def small_units(monkeypatch):
    monkeypatch.setattr(plan, "MIN_UNIT_ROWS", 100)  # a toy run cut into several units


@pytest.fixture(scope="module")
def single(run):
    return build_report(run.root, render=False, workers=1).metrics


def _same(got: dict, want: dict) -> None:
    assert_close(got["comparisons"], want["comparisons"])
    assert_close(got["attribution"], want["attribution"])
    assert got["findings"] == want["findings"]  # the doctor's state merged across units as well


def _sides(run: Run) -> list[str]:
    return ["rollout", "scores/bf16", "scores/fp32"]


def test_units_cover_every_row_once_with_sequences_whole(run, small_units):
    shape = run.manifest().routing
    units = plan_units(run, _sides(run), shape, workers=2)
    assert len(units) == 8  # 2 workers x 4 units each
    assert [u.index for u in units] == list(range(8))
    assert units[0].samples[0] == 0 and units[-1].samples[1] is None
    assert all(a.samples[1] == b.samples[0] for a, b in zip(units[:-1], units[1:]))
    parts = len(list((run.root / "rollout").glob("part-*.parquet")))
    assert parts == 3 and pq.ParquetFile(next((run.root / "rollout").glob("part-*.parquet"))).num_row_groups > 2
    for side in _sides(run):
        whole = np.concatenate(
            [b.column("sample_id").to_numpy() for _, b in iter_batches(run.side_dir(side), ["sample_id"])]
        )
        pieces = [
            np.concatenate(
                [
                    b.column("sample_id").to_numpy()
                    for _, b in iter_batches(run.side_dir(side), ["sample_id"], shape, u.samples)
                ]
            )
            for u in units
        ]
        np.testing.assert_array_equal(np.concatenate(pieces), whole)
        for a, b in zip(pieces[:-1], pieces[1:]):
            assert a[-1] < b[0]  # no sequence in two units


def test_workers_give_the_single_pass(run, single, small_units, monkeypatch):
    pools = []

    class CountedPool(workers.ProcessPoolExecutor):  # the real pool, counted: the split must really happen
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(workers, "ProcessPoolExecutor", CountedPool)
    _same(build_report(run.root, render=False, workers=2).metrics, single)
    assert pools == [2]
    error_split = single["attribution"]["numerics"]
    assert error_split and error_split[0]["n_tokens"] > 0
    assert all(c["worst_tokens"] and c["routing_forensics"]["margin_flip"] for c in single["comparisons"])


def test_one_worker_starts_no_pool(run, single, small_units, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("--workers 1 started a process pool")

    monkeypatch.setattr(workers, "ProcessPoolExecutor", no_pool)
    _same(build_report(run.root, render=False, workers=1).metrics, single)


@pytest.mark.parametrize("value", [0, -2])
def test_workers_below_one_is_an_error(run, value):
    with pytest.raises(ProbeError, match=rf"^--workers: {value}, expected an integer >= 1$"):
        build_report(run.root, render=False, workers=value)


def test_small_run_stays_in_process(run):
    assert [u.samples for u in plan_units(run, _sides(run), run.manifest().routing, workers=2)] == [None]


def _run_with_a_corrupt_page(tmp_path) -> tuple:
    """A run cut as the module's, with one page header of a score part overwritten (its footer is intact,
    so the plan reads it: only the worker that reads that row group finds out)."""
    root = write_synthetic_run(tmp_path / "run", SPEC)
    for side, rows in ROW_GROUP_ROWS.items():
        for path in sorted((root / side).glob("part-*.parquet")):
            pq.write_table(pq.read_table(path), path, row_group_size=rows)
    bad = sorted((root / "scores" / "bf16").glob("part-*.parquet"))[1]
    page = pq.ParquetFile(bad).metadata.row_group(3).column(4).data_page_offset  # logprob's first page
    data = bytearray(bad.read_bytes())
    data[page : page + 24] = b"\xff" * 24
    bad.write_bytes(bytes(data))
    return root, bad


def test_unreadable_part_in_a_worker_is_one_line_naming_it(tmp_path, small_units):
    root, bad = _run_with_a_corrupt_page(tmp_path)
    with pytest.raises(ProbeError) as raised:
        build_report(root, render=False, workers=2)
    message = str(raised.value)
    assert message.startswith(f"{bad}: row group 3: corrupt Parquet data") and "\n" not in message


def test_ray_without_the_extra_exits_2_naming_it(run):
    code = (
        "import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError, as when it is not installed
        "from mismatch_probe.cli import app\n"
        f"app(['report', {str(run.root)!r}, '--ray', 'local'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: --ray needs ray, which is not installed: pip install 'mismatch-probe[ray]'"
    ]


@pytest.mark.slow  # starts a local Ray instance
def test_ray_local_gives_the_single_pass(run, single, small_units, tmp_path):
    """One local Ray instance of 2 CPUs for every Ray check: started as `--ray local` starts it; the reports
    inside use that connection (as from an RL job's own Ray driver) and leave it running."""
    ray = pytest.importorskip("ray")
    with ray_session(LOCAL, 2) as cpus:
        assert cpus == 2 and ray.is_initialized()
        _same(build_report(run.root, render=False, workers=2, ray=LOCAL).metrics, single)
        _same(json.loads(run.metrics_path.read_text()), single)
        assert ray.is_initialized()
        root, bad = _run_with_a_corrupt_page(tmp_path)
        with pytest.raises(ProbeError) as raised:
            build_report(root, render=False, ray=LOCAL)
        assert str(raised.value).startswith(f"{bad}: row group 3: corrupt Parquet data")
        assert "\n" not in str(raised.value)
        _worker_deaths_are_retried_then_reported(run, single, tmp_path)
    assert not ray.is_initialized()


@pytest.mark.slow  # starts a local Ray instance in a second process
def test_ray_local_report_draws_its_figures_end_to_end(run, tmp_path):
    """`probe report RUN --ray local --workers 2`, figures drawn, as a user runs it: once the Ray driver had
    started its threads, drawing the figures in forked workers hung the report for good."""
    pytest.importorskip("ray")
    root = Path(shutil.copytree(run.root, tmp_path / "run"))
    shutil.rmtree(root / "report", ignore_errors=True)
    code = (
        "from mismatch_probe.report.stream import plan\n"
        "plan.MIN_UNIT_ROWS = 100\n"  # the toy run cut into several units, so the Ray tasks do the scan
        "from mismatch_probe.cli import app\n"
        f"app(['report', {str(root)!r}, '--ray', 'local', '--workers', '2'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    page = (root / "report" / "index.html").read_text()
    assert page.count("<svg") >= 6


def _worker_deaths_are_retried_then_reported(run, single, tmp_path):
    """A task whose worker process dies (os._exit, as an OOM kill would end it) is run again by Ray: every
    unit's first attempt dies here and the report is still the single pass. A unit that dies at every attempt
    fails the report with one line, exit code 1 (the input is not at fault)."""
    deaths = tmp_path / "deaths"
    deaths.mkdir()

    def dies_first_time(job, unit):  # pickled by value into the Ray workers
        import os

        marker = deaths / f"unit-{unit.index}"
        if not marker.exists():
            marker.touch()
            os._exit(1)
        return scan_unit(job, unit)

    def always_dies(job, unit):
        import os

        os._exit(1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_tasks, "scan_unit", dies_first_time)
        _same(build_report(run.root, render=False, workers=2, ray=LOCAL).metrics, single)
        died = sorted(path.name for path in deaths.iterdir())
        assert len(died) > 1 and died == sorted(f"unit-{i}" for i in range(len(died)))  # every unit died once
        patch.setattr(ray_tasks, "scan_unit", always_dies)
        patch.setattr(ray_tasks, "MAX_RETRIES", 1)
        with pytest.raises(WorkerLost) as raised:
            build_report(run.root, render=False, workers=2, ray=LOCAL)
    message = str(raised.value)
    assert message.startswith("Ray task for ") and "\n" not in message and raised.value.exit_code == 1


def test_range_cut_inside_unsorted_rows_is_an_error_not_a_silent_drop(tmp_path):
    """A row group whose statistics look fine but whose rows are out of order: cutting it at a sample id
    would hide the rows out of place, so the cut refuses it, naming the part."""
    root = write_synthetic_run(tmp_path / "run", SPEC)
    part = sorted((root / "scores" / "bf16").glob("part-*.parquet"))[0]
    table = pq.read_table(part)
    ids = table.column("sample_id").to_numpy()
    first, second, third = np.unique(ids)[:3]
    order = np.concatenate(
        [np.flatnonzero(ids == first), np.flatnonzero(ids == third), np.flatnonzero(ids == second)]
        + [np.flatnonzero(ids > third)]
    )
    pq.write_table(table.take(order), part)
    with pytest.raises(ProbeError, match=rf"row group 0: sample_id {second} after {third} \(rows must be sorted"):
        list(iter_batches(part.parent, ["sample_id"], Run(root).manifest().routing, (0, int(third))))


def test_footers_without_statistics_leave_the_run_in_one_unit(tmp_path, small_units):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    for path in sorted((root / "scores" / "fp32").glob("part-*.parquet")):
        pq.write_table(pq.read_table(path), path, row_group_size=50, write_statistics=False)
    run = Run(root)
    assert [u.samples for u in plan_units(run, _sides(run), run.manifest().routing, workers=2)] == [None]


def _shift_logprobs_one_later(side: Path) -> None:
    """The off-by-one bug as an engine writes it: each response token carries the next token's log-prob (the
    last one none). Parts keep their row counts, so the files stay cut where they were, mid-sample included."""
    parts = sorted(side.glob("part-*.parquet"))
    tables = [pq.read_table(p) for p in parts]
    whole = pl.from_arrow(pa.concat_tables(tables))
    whole = whole.with_columns(
        pl.when(pl.col("is_response")).then(pl.col("logprob").shift(-1).over("sample_id")).alias("logprob")
    )
    start = 0
    for path, table in zip(parts, tables):
        piece = whole.slice(start, table.num_rows).to_arrow().cast(table.schema)
        pq.write_table(piece, path, row_group_size=ROW_GROUP_ROWS[f"scores/{side.name}"])
        start += table.num_rows


def test_workers_give_the_single_pass_findings(tmp_path, small_units):
    """A planted setup bug: the doctor's state, split over units and merged, finds what the single pass finds."""
    root = write_synthetic_run(tmp_path / "run", SPEC)
    _shift_logprobs_one_later(root / "scores" / "fp32")
    want = build_report(root, render=False, workers=1).metrics["findings"]
    assert "off_by_one" in [f["check"] for f in want]
    assert build_report(root, render=False, workers=2).metrics["findings"] == want


def test_default_workers_are_half_the_cores_available(monkeypatch):
    """One process keeps about two cores busy (a reader thread per side), so the default halves the cores."""
    for cores, want in ((1, 1), (2, 1), (3, 1), (16, 8)):
        monkeypatch.setattr(workers, "available_cores", lambda cores=cores: cores)
        assert workers.parse_workers(None) == want
    assert workers.parse_workers(3) == 3
