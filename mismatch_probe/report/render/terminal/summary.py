"""`probe report`'s terminal view, on stdout: the verdict and summary table the page opens with, each
comparison's per-step timeline, then findings, notes and the files written. Progress and logs go to stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from mismatch_probe.doctor.state import FINDINGS_KEY
from mismatch_probe.progress import stdout_console
from mismatch_probe.report.keys.request import REQUEST_KEY, ReportRequest
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.report.render.terminal.policy import print_staleness
from mismatch_probe.report.render.terminal.remedies import print_remedies
from mismatch_probe.report.render.terminal.steps import timeline
from mismatch_probe.report.steps.words import drift_phrase, trend_phrase
from mismatch_probe.report.verdict.production import quantized_sides, side_setups
from mismatch_probe.report.verdict.summary import HEADER, rows, verdict
from mismatch_probe.rundir.layout import Run

if TYPE_CHECKING:
    from mismatch_probe.report.build import Report

PLAIN = dict(highlight=False, markup=False, soft_wrap=True)  # sentences quote side names and commands verbatim


def print_summary(result: Report, run) -> None:
    """The terminal view of a report: the verdict and summary table the page opens with, then findings,
    notes and file paths."""
    metrics = result.metrics
    run_dir = Run(run)
    infos = run_dir.side_infos()
    table_rows = rows(metrics, infos, result.bands, run_dir.manifest().routing.is_moe, quantized_sides(run_dir))
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
    for side, line in side_setups(run_dir).items():  # a quantized or truncated run: every side's setup
        out.print(f"setup: {side}: {line}", **PLAIN)
    print_timelines(out, metrics)
    print_staleness(out, metrics["comparisons"])
    print_remedies(out, metrics, PLAIN)
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
        header, step_rows = timeline(comp["steps"])
        for name in header:
            table.add_column(name, justify="left" if name == "step" else "right")
        for cells in step_rows:
            table.add_row(*(Text(cell) for cell in cells))
        out.print(table)
        words = [drift_phrase(comp.get("drift")), trend_phrase(comp.get("trend"))]
        said = [w for w in words if w] or ["k3 stayed flat over the steps (no drift, no trend)"]
        out.print(f"steps: {label}: {'; '.join(said)}", **PLAIN)
