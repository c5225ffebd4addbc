"""`probe gate`'s terminal view, on stdout: the table of checks, the history note and the summary line, then
each doctor finding and whether --allow accepts it. The checks themselves are computed in check.py and
findings.py; `--json` and `--junit` write them from there."""

from __future__ import annotations

from mismatch_probe.gate.check import Check
from mismatch_probe.gate.drift import DRIFT
from mismatch_probe.gate.history import HISTORY
from mismatch_probe.gate.trust import summary_line
from mismatch_probe.progress import stdout_console
from mismatch_probe.report.numbers import times, value, with_interval


def print_checks(checks: list[Check], run) -> None:
    from rich.table import Table

    table = Table(title=f"gate: {run}")
    for name in ("comparison", "metric", "checked", "limit", "value [95% interval]", "result"):
        table.add_column(name, justify="right" if name.startswith(("limit", "value")) else "left")
    style = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skipped": "[yellow]skipped[/]"}
    for c in checks:
        limit = value(c.limit)
        shown = with_interval(c.value, c.ci95)
        if c.checked == "baseline":
            limit = "baseline " + with_interval(c.baseline, c.baseline_ci95)
        elif c.checked == DRIFT:
            limit = f"{value(c.limit)}×"
            shown = "no rise" if c.value is None else f"{times(c.value, c.ci95)} from step {c.step}"
        elif c.checked == HISTORY and c.metric != "history runs":
            limit = "history ≤ " + value(c.limit) if c.limit is not None else "history"
        table.add_row(c.comparison, c.metric, c.checked, limit, shown, style[c.status])
    out = stdout_console()
    out.print(table)
    if any(c.checked == HISTORY and c.metric == "history runs" for c in checks):
        n = next(int(c.value) for c in checks if c.metric == "history runs")
        out.print(
            f"history: {n} runs given, at least 3 are needed to gate against history; not gated "
            "(--strict fails the gate instead)",
            highlight=False,
            markup=False,
        )
    out.print(summary_line(checks), highlight=False)


def print_findings(findings: list[dict]) -> None:
    out = stdout_console()
    for f in findings:
        verdict = "allowed (--allow)" if f["allowed"] else f"REFUSED (pass --allow {f['check']} to accept it)"
        out.print(
            f"doctor finding {f['check']}: {verdict}: {f['found']}", highlight=False, markup=False, soft_wrap=True
        )
