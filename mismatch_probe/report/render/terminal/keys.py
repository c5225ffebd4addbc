"""`probe keys`: the key rosetta (report/keys/rosetta.py) on the terminal, as a table, markdown or JSON."""

from __future__ import annotations

import json

from mismatch_probe.errors import ProbeError
from mismatch_probe.report.keys.metric_key import PEERS
from mismatch_probe.report.keys.rosetta import markdown, rows

FORMATS = ("table", "markdown", "json")


def print_keys(format: str) -> None:  # noqa: A002 (the command's --format)
    if format not in FORMATS:
        raise ProbeError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    if format == "json":
        print(json.dumps(rows(), indent=1))
    elif format == "markdown":
        print(markdown())
    else:
        _print_table()


def _print_table() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="metric keys and their names in peer frameworks", show_lines=True)
    for column in ("key", "formula", *PEERS):
        table.add_column(column, overflow="fold")
    for row in rows():
        formula = row["formula"] + (f"\n[dim]{row['note']}[/dim]" if row["note"] else "")
        table.add_row(row["key"], formula, *(row[peer] for peer in PEERS))
    Console().print(table)
