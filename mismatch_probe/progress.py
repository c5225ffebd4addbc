"""Rich progress bars for the long-running commands (on stderr, so stdout stays scriptable)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Logs and CI are not terminals: give tables room instead of folding them at 80 columns.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def stdout_console() -> Console:
    """Tables that are the command's output (report, gate) go to stdout; in logs and CI, unfolded."""
    return Console(width=None if sys.stdout.isatty() else 200)
