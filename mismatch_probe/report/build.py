"""`probe report`: metrics.json, plots and index.html for every compared pair of sides of a run."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table
from rich.text import Text

from mismatch_probe.doctor.state import FINDINGS_KEY, Doctor
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.progress import stdout_console
from mismatch_probe.report.accumulators.sequence_stats import DEFAULT_GEO_BOUNDS, DEFAULT_TIS_CAPS
from mismatch_probe.report.accumulators.worst_tokens import DEFAULT_WORST
from mismatch_probe.report.keys.request import REQUEST_KEY, ReportRequest, resolve
from mismatch_probe.report.metrics_file import METRICS_SCHEMA_VERSION
from mismatch_probe.report.policy.decomposition import DEFAULT_PPO_BOUNDS
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.report.render.terminal.policy import print_staleness
from mismatch_probe.report.render.terminal.steps import timeline
from mismatch_probe.report.steps.split import DEFAULT_MIN_RATIO
from mismatch_probe.report.steps.words import drift_phrase, trend_phrase
from mismatch_probe.report.stream.comparison import Comparison
from mismatch_probe.report.stream.ray_tasks import import_ray
from mismatch_probe.report.stream.scan import ScanJob
from mismatch_probe.report.stream.token_context import attach_context
from mismatch_probe.report.stream.workers import parse_workers, scan_run
from mismatch_probe.report.verdict.attribution import attribute, numerics_plan
from mismatch_probe.report.verdict.bands import PUBLISHED, Bands, read_bands
from mismatch_probe.report.verdict.summary import HEADER, evidence_groups, rows, verdict
from mismatch_probe.rundir.layout import METRICS_FILE, REPORT_LAYOUT, SCORES, Run
from mismatch_probe.rundir.ownership import refuse_foreign

PLAIN = dict(highlight=False, markup=False, soft_wrap=True)  # sentences quote side names and commands verbatim


@dataclass
class Report:
    directory: Path
    metrics: dict
    reused_request: bool = False  # options came from the request remembered in the last metrics.json
    bands: Bands = PUBLISHED  # what the verdict words were judged against

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    @property
    def index_path(self) -> Path:
        return self.directory / "index.html"


def compute_comparisons(
    run: Run,
    pairs,
    thresholds,
    routing_scope: str,
    tis_caps=DEFAULT_TIS_CAPS,
    geo_bounds=DEFAULT_GEO_BOUNDS,
    worst: int = DEFAULT_WORST,
    fp32_sides=None,
    workers: int = 1,
    ray: str | None = None,
    doctor: Doctor | None = None,
    drift_ratio: float = DEFAULT_MIN_RATIO,
    ppo_bounds: tuple = DEFAULT_PPO_BOUNDS,
) -> list[Comparison]:
    """One streaming pass over every side involved (split over `workers` processes, or Ray tasks when `ray`
    names a cluster), then each comparison finished. A `Doctor` given gets the checks' state of the same
    pass merged into it."""
    job = ScanJob(
        run_root=run.root,
        pairs=list(pairs),
        thresholds=thresholds,
        routing_scope=routing_scope,
        tis_caps=tis_caps,
        geo_bounds=geo_bounds,
        worst=worst,
        fp32_sides=fp32_sides,
        doctor=doctor is not None,
        drift_ratio=drift_ratio,
        ppo_bounds=ppo_bounds,
    )
    scanned = scan_run(job, workers, ray)
    comparisons = scanned.comparisons
    if doctor is not None:
        doctor.merge(scanned.doctor)
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
    workers: int | None = None,
    ray: str | None = None,
    bands_file: Path | None = None,
    drift_ratio: float | None = None,
    ppo_bounds=None,
) -> Report:
    """metrics.json, and unless render=False the plots and index.html. Options left None take the value the
    run's last report was asked for (see report_request), else the default. pairs: `A:B` strings or
    (reference, candidate) tuples replace the pairs, `+A:B` adds one. workers: processes for the pass
    (default: half the cores available); ray: a Ray address (`local`, `auto`, `ray://host:port`) to run it on."""
    workers = parse_workers(workers)
    if ray is not None:
        import_ray()  # before anything is read: without the extra, say so at once
    # matplotlib takes a quarter of a second to import: do it while the first row groups are read
    plotting = threading.Thread(
        target=importlib.import_module, args=("mismatch_probe.report.render.plots",), daemon=True
    )
    if render:
        plotting.start()

    run = Run(run_root)
    manifest = run.manifest()
    bands = PUBLISHED if bands_file is None else read_bands(Path(bands_file))  # a bad file costs no pass
    request, reused = resolve(
        run,
        pairs,
        thresholds=thresholds,
        routing_scope=routing_scope,
        tis_caps=tis_caps,
        geo_bounds=geo_bounds,
        worst=worst,
        drift_ratio=drift_ratio,
        ppo_bounds=ppo_bounds,
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
        run,
        pairs,
        thresholds,
        routing_scope,
        tis_caps,
        geo_bounds,
        worst,
        fp32_sides,
        workers,
        ray,
        doctor,
        drift_ratio=request.drift_ratio,
        ppo_bounds=request.ppo_bounds,
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
            return Report(directory=directory, metrics=metrics, reused_request=reused, bands=bands)
        plotting.join()
        from mismatch_probe.report.render.page import write_index
        from mismatch_probe.report.render.plots import write_plots

        infos = run.side_infos()
        table = rows(metrics, infos, bands, manifest.routing.is_moe)
        groups = evidence_groups(table, infos)
        scatters = [c.probability.scatter for c in comparisons]
        kind, band = bands.kind(manifest.routing.is_moe)
        band = (kind, band.low, band.high, bands.acceptable)
        plots = write_plots(directory, metrics["comparisons"], scatters, groups, band)
        write_json_atomic(run.metrics_path, metrics)
        write_index(directory, run, manifest, metrics, plots, bands)
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report ({exc.strerror or exc})") from exc
    return Report(directory=directory, metrics=metrics, reused_request=reused, bands=bands)


def print_summary(result: Report, run) -> None:
    """The terminal view of a report, on stdout: the verdict and summary table the page opens with, then
    findings, notes and file paths. Progress and logs went to stderr."""
    metrics = result.metrics
    run_dir = Run(run)
    infos = run_dir.side_infos()
    table_rows = rows(metrics, infos, result.bands, run_dir.manifest().routing.is_moe)
    out = stdout_console()
    out.print(verdict(metrics, table_rows), **PLAIN)
    for finding in metrics.get(FINDINGS_KEY) or []:
        out.print(f"doctor: {finding['check']}: {finding['found']}", **PLAIN)
    table = Table(title=f"mismatch: {run}")
    for name in HEADER:
        table.add_column(name, justify="right" if name.startswith(("k3", "F(", "router")) else "left")
    for row in table_rows:
        table.add_row(*(Text(cell) for cell in row.cells()))
    out.print(table)
    print_timelines(out, metrics)
    print_staleness(out, metrics["comparisons"])
    attribution = metrics.get("attribution") or {}
    for line in attribution.get("headlines", []):
        out.print(f"finding: {line}", **PLAIN)
    for line in attribution.get("missing", []):
        out.print(f"missing: {line}", **PLAIN)
    for note in sorted({n for c in metrics["comparisons"] for n in c["notes"]}):
        out.print(f"note: {note}", **PLAIN)
    if result.reused_request:
        request = ReportRequest.parsed(**metrics[REQUEST_KEY])
        out.print(
            f"note: as the last report of this run: {' '.join(request.options()) or 'the default pairs'} "
            "(an option given replaces its remembered value; --pair +A:B adds a pair, --pair A:B replaces them)",
            **PLAIN,
        )
    out.print(f"metrics: {result.metrics_path}", **PLAIN)
    out.print(f"report: {result.index_path}", **PLAIN)


def print_timelines(out, metrics: dict) -> None:
    """Each comparison's per-step timeline, when the run records steps, with its drift and trend."""
    for comp in metrics["comparisons"]:
        if not comp.get("steps") or is_policy(comp):
            continue
        label = f"{comp['reference']} vs {comp['candidate']}"
        table = Table(title=f"per step: {label}")
        header, rows = timeline(comp["steps"])
        for name in header:
            table.add_column(name, justify="left" if name == "step" else "right")
        for cells in rows:
            table.add_row(*(Text(cell) for cell in cells))
        out.print(table)
        words = [drift_phrase(comp.get("drift")), trend_phrase(comp.get("trend"))]
        said = [w for w in words if w] or ["k3 stayed flat over the steps (no drift, no trend)"]
        out.print(f"steps: {label}: {'; '.join(said)}", **PLAIN)
