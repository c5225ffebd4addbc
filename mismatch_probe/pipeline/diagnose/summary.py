"""The screen `probe diagnose` ends with: the verdict with its band, the shares with their intervals, the doctor's
finding, locate's sentence, the best measured remedy, then where the plan and the page are. Read from the report's
metrics.json and the plan, so a reused diagnosis prints the same screen."""

from __future__ import annotations

import json

from rich.table import Table

from mismatch_probe.doctor.state import FINDINGS_KEY
from mismatch_probe.jsonfile import read_json
from mismatch_probe.pipeline.diagnose.memory import memory_why
from mismatch_probe.pipeline.diagnose.passes import LOCATE, Pass
from mismatch_probe.pipeline.diagnose.run import Diagnosis
from mismatch_probe.progress import stdout_console
from mismatch_probe.report import numbers
from mismatch_probe.report.verdict.bands import PUBLISHED
from mismatch_probe.report.verdict.best_remedy import best_remedy
from mismatch_probe.report.verdict.production import quantized_sides
from mismatch_probe.report.verdict.summary import rows, verdict
from mismatch_probe.rundir.layout import Run

SHARES = (
    ("routing_share", "routing"),
    ("quant_share", "quantization"),
    ("truncation_share", "truncation"),
    ("decode_share", "the engine's decode path"),
)
PLAIN = dict(highlight=False, markup=False, soft_wrap=True)


def share_lines(metrics: dict) -> list[str]:
    """`routing explains 91.4% [88.0%, 93.7%] of k3 (rollout vs hf bf16)`, one per share entry."""
    attribution = metrics.get("attribution") or {}
    lines = []
    for key, word in SHARES:
        for e in attribution.get(key) or []:
            where = f"{e['reference']} vs {e['engine']} {e['dtype']}"
            lines.append(f"{word} explains {numbers.percent(e['share'], e.get('share_ci95'))} of k3 ({where}; {key})")
    return lines


def screen(diagnosis: Diagnosis) -> list[str]:
    run = Run(diagnosis.plan["run"])
    by_name = {p.name: p for p in diagnosis.passes}
    metrics = read_json(run.metrics_path) if run.metrics_path.is_file() else None
    lines = []
    if metrics is None:
        lines.append("verdict: no report (no score set was made): see the plan for what was skipped and why")
    else:
        table = rows(metrics, run.side_infos(), PUBLISHED, run.manifest().routing.is_moe, quantized_sides(run))
        lines.append(f"verdict: {verdict(metrics, table)}")
        lines += [f"share: {line}" for line in share_lines(metrics)] or ["share: none measured"]
        findings = metrics.get(FINDINGS_KEY) or []
        doctor = "; ".join(f"{f['check']}: {f['found']}" for f in findings) or "no setup bug found"
        lines.append(f"doctor: {doctor}")
    located = by_name.get(LOCATE)
    lines.append(f"locate: {_said(located)}")
    if metrics is not None:
        lines.append(f"best remedy: {best_remedy(metrics)}")
    if diagnosis.plan_path is not None:
        lines.append(f"plan: {diagnosis.plan_path}")
    if diagnosis.page.is_file():
        lines.append(f"page: {diagnosis.page}")
    return lines


def _said(p: Pass | None) -> str:
    if p is None:
        return "not planned"
    if p.result:
        return p.result
    return f"{p.status}: {p.why}" if p.why else p.status


def print_plan(diagnosis: Diagnosis) -> None:
    out = stdout_console()
    table = Table(title=f"diagnose plan: {diagnosis.plan['run']}")
    for column in ("pass", "status", "estimate s", "seconds", "checkpoint", "why / command"):
        table.add_column(column, justify="right" if column.endswith("s") and column != "pass" else "left")
    for p in diagnosis.passes_in_order():
        est = "" if p.estimate_s is None else f"{p.estimate_s:.2f}"
        secs = "" if p.seconds is None else f"{p.seconds:.1f}"
        table.add_row(p.name, p.status, est, secs, p.checkpoint, memory_why(p) or p.why or p.command)
    out.print(table)
    loads = diagnosis.plan["checkpoint_loads"]
    out.print(f"checkpoint loads: planned {loads['planned']}, made {loads['made']}", **PLAIN)


def print_screen(diagnosis: Diagnosis) -> None:
    out = stdout_console()
    for line in screen(diagnosis):
        out.print(line, **PLAIN)


def json_text(diagnosis: Diagnosis) -> str:
    return json.dumps(diagnosis.plan | {"screen": screen(diagnosis)}, indent=2)
