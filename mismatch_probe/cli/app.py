"""The typer app of `probe`: its callback (--debug, --version) and the one error path every command runs under.

The commands live in pipeline_commands, report_commands and info_commands; the package's __init__ registers them,
so import `app` from `mismatch_probe.cli`, not from here.
"""

from __future__ import annotations

import functools
import os

import rich.markup
import typer

from mismatch_probe import __version__
from mismatch_probe.errors import ProbeError
from mismatch_probe.help_flags import flag
from mismatch_probe.progress import console

HELP = "Measure the training-inference mismatch of an LLM checkpoint: log-probs and MoE routing."
app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, pretty_exceptions_enable=False)
DEBUG_ENV = "PROBE_DEBUG"


def print_version(requested: bool) -> None:
    if requested:
        typer.echo(f"mismatch-probe {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = flag(False, "--debug", help="Show tracebacks for errors."),
    version: bool = flag(False, "--version", callback=print_version, is_eager=True, help="Print the version and exit."),
) -> None:
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
            # Escape: messages quote user text and Python reprs whose [brackets] rich would eat as markup.
            console.print(
                f"[bold red]error:[/] {rich.markup.escape(str(exc))}", highlight=False, soft_wrap=True, emoji=False
            )
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted: finished parts are kept; re-run with --resume to continue")
            raise typer.Exit(130) from None
        except Exception as exc:  # out of memory where no stage named it (engines/memory.py names most)
            from mismatch_probe.engines.memory import is_out_of_memory, unplaced_line

            if os.environ.get(DEBUG_ENV) or not is_out_of_memory(exc):
                raise
            console.print(
                f"[bold red]error:[/] {rich.markup.escape(unplaced_line(exc))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None

    return wrapper


def register(name: str, fn) -> None:
    """Add one command to the app, under the error path."""
    app.command(name)(handles_errors(fn))
