"""The `probe` command line: a thin shell over the pipeline modules.

app.py holds the typer app and its error path; each *_commands module holds one group of commands as plain
functions, and COMMANDS below registers them, in the order `probe --help` lists them.
"""

from __future__ import annotations

from mismatch_probe.cli import (
    diagnose_command,
    info_commands,
    locate_command,
    pipeline_commands,
    report_commands,
    sweep_command,
)
from mismatch_probe.cli.app import app, register

# The whole diagnosis, then make a run, read it, then what this install holds. The list, not import order, fixes the help's order.
COMMANDS = (
    ("diagnose", diagnose_command.diagnose),
    ("generate", pipeline_commands.generate),
    ("rescore", pipeline_commands.rescore),
    ("sweep", sweep_command.sweep),
    ("demo", pipeline_commands.demo),
    ("import", pipeline_commands.import_dump),
    ("report", report_commands.report),
    ("gate", report_commands.gate),
    ("doctor", report_commands.doctor),
    ("locate", locate_command.locate),
    ("compare", report_commands.compare),
    ("env", info_commands.env),
    ("keys", info_commands.keys),
)
for _name, _fn in COMMANDS:
    register(_name, _fn)

__all__ = ["app"]
