"""The `probe` command line: a thin shell over the pipeline modules."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import ProbeError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
console = Console(stderr=True)
DEBUG_ENV = "PROBE_DEBUG"


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    """Measure the training-inference mismatch of an LLM checkpoint (log-probs and MoE routing)."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


def handles_errors(fn):
    """One error path: a one-line message and exit 2 (bad input) or 1 (failure); --debug re-raises."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ProbeError as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted: finished parts are kept; re-run with --resume to continue")
            raise typer.Exit(130) from None

    return wrapper


def command(*args, **kwargs):
    def register(fn):
        return app.command(*args, **kwargs)(handles_errors(fn))

    return register


# ---- report and gate -------------------------------------------------------------------------


@command("report")
def report(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Compute the mismatch metrics, plots and HTML report of a run."""
    raise ProbeError("report is not available yet")


@command("gate")
def gate(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Fail (exit 1) when a metric exceeds its limit."""
    raise ProbeError("gate is not available yet")


if __name__ == "__main__":
    sys.exit(app())
