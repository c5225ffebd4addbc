"""`probe report`: metrics.json, plots and index.html for every compared pair of sides of a run."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from mismatch_probe.doctor.state import FINDINGS_KEY, Doctor
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.progress import stdout_console
from mismatch_probe.report.align import aligned_chunks
from mismatch_probe.report.attribution import attribute, numerics_plan
from mismatch_probe.report.bootstrap import format_with_interval
from mismatch_probe.report.comparison import Comparison
from mismatch_probe.report.metrics_file import METRICS_SCHEMA_VERSION
from mismatch_probe.report.pair_frame import FrameBuilder, PairFrame
from mismatch_probe.report.probability import extreme_key
from mismatch_probe.report.request import REQUEST_KEY, ReportRequest, resolve
from mismatch_probe.report.sequence_stats import DEFAULT_GEO_BOUNDS, DEFAULT_TIS_CAPS
from mismatch_probe.report.token_context import attach_context
from mismatch_probe.report.worst_tokens import DEFAULT_WORST
from mismatch_probe.rundir.layout import METRICS_FILE, REPORT_LAYOUT, SCORES, Run
from mismatch_probe.rundir.ownership import refuse_foreign

PLAIN = dict(highlight=False, markup=False, soft_wrap=True)  # sentences quote side names and commands verbatim


@dataclass
class Report:
    directory: Path
    metrics: dict
    reused_request: bool = False  # options came from the request remembered in the last metrics.json

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    @property
    def index_path(self) -> Path:
        return self.directory / "index.html"


def new_comparisons(
    run: Run,
    pairs,
    thresholds,
    tis_caps=DEFAULT_TIS_CAPS,
    geo_bounds=DEFAULT_GEO_BOUNDS,
    worst: int = DEFAULT_WORST,
    fp32_sides=None,
) -> list[Comparison]:
    """Empty accumulators for each pair. fp32_sides: {(reference, candidate): fp32 side} for the comparisons
    whose error is split per side."""
    shape, fp32_sides = run.manifest().routing, fp32_sides or {}
    return [
        Comparison.new(
            reference, candidate, shape, thresholds, tis_caps, geo_bounds, worst, fp32_sides.get((reference, candidate))
        )
        for reference, candidate in pairs
    ]


def chunk_frames(run: Run, comparisons: list[Comparison], routing_scope: str) -> Iterator[list[PairFrame]]:
    """Per chunk of aligned rows, one frame per comparison. Each side is read once whatever the number of pairs."""
    shape = run.manifest().routing
    keys = [comp.sides for comp in comparisons]
    sides = list(dict.fromkeys([side for key in keys for side in key[:2]] + [key[2] for key in keys if key[2]]))
    builder = FrameBuilder(shape=shape, routing_scope=routing_scope)
    for chunks in aligned_chunks(run, sides, shape):
        yield builder.frames(chunks, keys)


def compute_comparisons(
    run: Run,
    pairs,
    thresholds,
    routing_scope: str,
    tis_caps=DEFAULT_TIS_CAPS,
    geo_bounds=DEFAULT_GEO_BOUNDS,
    worst: int = DEFAULT_WORST,
    fp32_sides=None,
    doctor=None,
) -> list[Comparison]:
    """One streaming pass over every side involved, then each comparison finished. A `Doctor` given runs
    its checks in the same pass."""
    comparisons = new_comparisons(run, pairs, thresholds, tis_caps, geo_bounds, worst, fp32_sides)
    for frames in chunk_frames(run, comparisons, routing_scope):
        for comp, frame in zip(comparisons, frames):
            comp.update(frame)
        if doctor is not None:
            doctor.update(frames)
    for comp in comparisons:
        comp.finish()
    attach_context(run, run.manifest().model, [comp.worst for comp in comparisons])
    return comparisons


def build_report(
    run_root,
    pairs=None,
    thresholds=None,
    routing_scope: str | None = None,
    tis_caps=None,
    geo_bounds=None,
    worst: int | None = None,
    render: bool = True,
) -> Report:
    """metrics.json, and unless render=False the plots and index.html. Options left None take the value the
    run's last report was asked for (see report_request), else the default. pairs: `A:B` strings or
    (reference, candidate) tuples replace the pairs, `+A:B` adds one."""
    # matplotlib takes a quarter of a second to import: do it while the first row groups are read
    plotting = threading.Thread(
        target=importlib.import_module, args=("mismatch_probe.report.render.plots",), daemon=True
    )
    if render:
        plotting.start()

    run = Run(Path(run_root))
    manifest = run.manifest()
    request, reused = resolve(
        run,
        pairs,
        thresholds=thresholds,
        routing_scope=routing_scope,
        tis_caps=tis_caps,
        geo_bounds=geo_bounds,
        worst=worst,
    )
    thresholds, routing_scope, worst = request.thresholds, request.routing_scope, request.worst
    tis_caps, geo_bounds = request.tis_caps, request.geo_bounds
    pairs = request.pair_list(run)
    if not pairs:
        raise ProbeError(f"{run.root / SCORES}: no score sets to compare the rollout with (run `probe rescore` first)")
    fp32_sides = numerics_plan(run, pairs)
    sides = [side for pair in pairs for side in pair] + list(fp32_sides.values())
    run.check_sides(manifest, list(dict.fromkeys(sides)))
    directory = run.report_dir
    if directory.exists() and not directory.is_dir():
        raise ProbeError(f"{directory}: exists and is not a directory; cannot write the report there")
    refuse_foreign(directory, REPORT_LAYOUT)  # the report replaces its folder's files: only probe's may be there
    try:  # before the long read: an unwritable report folder should not cost a full pass
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".write-test").touch()
        (directory / ".write-test").unlink()
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report there ({exc.strerror or exc})") from exc
    doctor = Doctor(run, pairs)
    comparisons = compute_comparisons(
        run, pairs, thresholds, routing_scope, tis_caps, geo_bounds, worst, fp32_sides, doctor=doctor
    )
    metrics = {
        "schema_version": METRICS_SCHEMA_VERSION,
        "comparisons": [c.to_json(routing_scope) for c in comparisons],
        REQUEST_KEY: request.to_json(),  # what a plain `probe report RUN` asks for next time
    }
    metrics["attribution"] = attribute(run, comparisons, metrics["comparisons"], request)
    metrics[FINDINGS_KEY] = [finding.to_json() for finding in doctor.findings()]  # `probe doctor`'s findings
    try:
        if not render:
            write_json_atomic(run.metrics_path, metrics)
            return Report(directory=directory, metrics=metrics, reused_request=reused)
        plotting.join()
        from mismatch_probe.report.render.page import write_index
        from mismatch_probe.report.render.plots import write_plots

        plots = write_plots(directory, metrics["comparisons"], [c.probability.scatter for c in comparisons])
        write_json_atomic(run.metrics_path, metrics)
        write_index(directory, run, manifest, metrics, plots)
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report ({exc.strerror or exc})") from exc
    return Report(directory=directory, metrics=metrics, reused_request=reused)


def print_summary(result: Report, run) -> None:
    """The terminal view of a report: headline metrics per comparison, notes and file paths."""
    comparisons = result.metrics["comparisons"]
    extreme = [extreme_key(2)] if any(extreme_key(2) in c["metrics"] for c in comparisons) else []
    columns = ["n_tokens", "k3_kl", *extreme, "argmax_flip_rate", "router_diff_rate", "token_diff_rate"]
    table = Table(title=f"mismatch: {run}")
    table.add_column("comparison")
    for name in columns:
        table.add_column(name, justify="right")
    for comp in comparisons:
        cells = [
            format_with_interval(comp["metrics"].get(name), comp["metrics"].get(f"{name}_ci95")) for name in columns
        ]
        table.add_row(f"{comp['reference']} vs {comp['candidate']}", *cells)
    out = stdout_console()
    for finding in result.metrics.get(FINDINGS_KEY, []):
        out.print(f"doctor: {finding['check']}: {finding['found']}", **PLAIN)
    attribution = result.metrics.get("attribution") or {}
    for line in attribution.get("headlines", []):
        out.print(f"finding: {line}", **PLAIN)
    for line in attribution.get("missing", []):
        out.print(f"missing: {line}", **PLAIN)
    out.print(table)
    for note in sorted({n for c in comparisons for n in c["notes"]}):
        out.print(f"note: {note}")
    if result.reused_request:
        request = ReportRequest.parsed(**result.metrics[REQUEST_KEY])
        out.print(
            f"note: as the last report of this run: {' '.join(request.options()) or 'the default pairs'} "
            "(an option given replaces its remembered value; --pair +A:B adds a pair, --pair A:B replaces them)",
            **PLAIN,
        )
    out.print(f"metrics: {result.metrics_path}")
    out.print(f"report: {result.index_path}")
