"""`probe report`: metrics.json, plots and index.html for every compared pair of sides of a run."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.doctor.state import FINDINGS_KEY, Doctor
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.report.keys.request import REQUEST_KEY, ReportRequest, resolve
from mismatch_probe.report.metrics_file import METRICS_SCHEMA_VERSION
from mismatch_probe.report.stream.comparison import Comparison
from mismatch_probe.report.stream.ray_tasks import import_ray
from mismatch_probe.report.stream.scan import ScanJob
from mismatch_probe.report.stream.token_context import attach_context
from mismatch_probe.report.stream.workers import parse_workers, scan_run
from mismatch_probe.report.verdict.attribution import attribute, error_split_plan
from mismatch_probe.report.verdict.bands import PUBLISHED, Bands, read_bands
from mismatch_probe.report.verdict.remedies import load_sweep, remedies, sweep_pairs
from mismatch_probe.report.verdict.remedy_words import REMEDIES_KEY
from mismatch_probe.report.verdict.summary import evidence_groups, rows
from mismatch_probe.rundir.layout import METRICS_FILE, REPORT_LAYOUT, SCORES, Run
from mismatch_probe.rundir.ownership import refuse_foreign


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
    request: ReportRequest,
    *,
    fp32_sides=None,
    workers: int = 1,
    ray: str | None = None,
    doctor: Doctor | None = None,
) -> list[Comparison]:
    """One streaming pass over every side involved (split over `workers` processes, or Ray tasks when `ray`
    names a cluster), then each comparison finished; `request` carries the options (thresholds, routing
    scope, caps, bounds, ...). A `Doctor` given gets the checks' state of the same pass merged into it."""
    job = ScanJob(
        run_root=run.root, pairs=list(pairs), request=request, fp32_sides=fp32_sides, doctor=doctor is not None
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
    *,
    render: bool = True,
    workers: int | None = None,
    ray: str | None = None,
    bands_file: Path | None = None,
    **options,
) -> Report:
    """metrics.json, and unless render=False the plots and index.html. options: the report's options by name
    (report/keys/request.py OPTIONS: thresholds, routing_scope, tis_caps, geo_bounds, worst, drift_ratio,
    ppo_bounds); each one left out or None takes the value the run's last report was asked for, else the
    default. pairs: `A:B` strings or (reference, candidate) tuples replace the pairs, `+A:B` adds one.
    workers: processes for the pass (default: half the cores available); ray: a Ray address (`local`,
    `auto`, `ray://host:port`) to run it on."""
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
    request, reused = resolve(run, pairs, **options)
    sweep = load_sweep(run)  # RUN/sweep.json: its base and training variants are compared in the pass
    pairs = sweep_pairs(run, sweep, request.pair_list(run))
    if not pairs:
        raise ProbeError(f"{run.root / SCORES}: no score sets to compare the rollout with (run `probe rescore` first)")
    fp32_sides = error_split_plan(run, pairs)
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
        run, pairs, request, fp32_sides=fp32_sides, workers=workers, ray=ray, doctor=doctor
    )
    metrics = {
        "schema_version": METRICS_SCHEMA_VERSION,
        "comparisons": [c.to_json(request.routing_scope) for c in comparisons],
        REQUEST_KEY: request.to_json(),  # what a plain `probe report RUN` asks for next time
    }
    metrics["attribution"] = attribute(run, comparisons, metrics["comparisons"], request)
    measured = remedies(run, sweep, comparisons, metrics["comparisons"])
    if measured is not None:  # only a swept run has the key: other runs' metrics.json keep theirs
        metrics[REMEDIES_KEY] = measured
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
