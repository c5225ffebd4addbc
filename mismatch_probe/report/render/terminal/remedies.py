"""`probe report`'s table of measured remedies (metrics.json `remedies`), for a run with RUN/sweep.json."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from mismatch_probe.report.verdict.best_remedy import best_remedy
from mismatch_probe.report.verdict.remedy_words import HEADER, REMEDIES_KEY, base_line, cells


def print_remedies(out, metrics: dict, plain: dict) -> None:
    entries = metrics.get(REMEDIES_KEY)
    if not entries:
        return
    table = Table(title="measured remedies (probe sweep)")
    for i, name in enumerate(HEADER):
        table.add_column(name, justify="right" if 3 <= i != 5 else "left")
    for entry in entries:
        table.add_row(*(Text(cell) for cell in cells(entry)))
    out.print(table)
    out.print(f"remedies: {base_line(entries)}; ratio = variant k3 / base k3, speed = variant tok/s / base's", **plain)
    out.print(f"best remedy: {best_remedy(metrics)}", **plain)
