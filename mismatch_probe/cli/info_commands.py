"""`probe env` and `probe keys`: what this install holds, no run needed."""

from __future__ import annotations

import json

import typer

from mismatch_probe.help_flags import flag


def env(as_json: bool = flag(False, "--json", help="Print the environment as JSON.")) -> None:
    """Versions of probe, Python, torch (CUDA, GPUs) and the engines' packages, and which engines can run here."""
    from mismatch_probe.environment import collect, print_environment

    found = collect()
    if as_json:
        typer.echo(json.dumps(found.to_json(), indent=2))
    else:
        print_environment(found)


def keys(
    format: str = typer.Option("table", "--format", help="table, markdown (the README's key table) or json."),  # noqa: A002
) -> None:
    """Every metric key: its formula and the name verl, slime/miles, NeMo-RL and prime-rl log it under, or none."""
    from mismatch_probe.report.render.terminal.keys import print_keys

    print_keys(format)
