"""`probe env` and `probe keys`: what this install holds (and, given a run, how its sides were produced)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer

from mismatch_probe.help_flags import flag


def env(
    run: Path | None = typer.Argument(
        None, help="A run: also each side's engine, dtype, quantization and sampling, as its manifests record them."
    ),
    as_json: bool = flag(False, "--json", help="Print the environment as JSON."),
) -> None:
    """Versions of probe, Python, torch (CUDA, GPUs) and the engines' packages, and which engines can run here;
    with RUN, how each of its sides was produced."""
    from mismatch_probe.environment import collect, print_environment, print_run_setup, run_setup

    sides = None if run is None else run_setup(run)  # a bad run fails first, with its one line
    found = collect()
    if as_json:
        extra = {} if sides is None else {"run": {"path": str(run), "sides": [asdict(s) for s in sides]}}
        typer.echo(json.dumps(found.to_json() | extra, indent=2))
        return
    print_environment(found)
    if sides is not None:
        print_run_setup(run, sides)


def keys(
    format: str = typer.Option("table", "--format", help="table, markdown (the README's key table) or json."),  # noqa: A002
) -> None:
    """Every metric key: its formula and the name verl, slime/miles, NeMo-RL and prime-rl log it under, or none."""
    from mismatch_probe.report.render.terminal.keys import print_keys

    print_keys(format)
