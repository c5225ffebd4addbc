"""`probe CMD --help` shows boolean flags as flags: no `<bool>` type beside them, as if they took a value."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from mismatch_probe.cli import app

COMMANDS = typer.main.get_command(app).commands


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_flags_without_a_type(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "--help" in result.output and "<bool>" not in result.output


def test_gate_help_keeps_toml_table_names():
    result = CliRunner().invoke(app, ["gate", "--help"], env={"COLUMNS": "160"})
    assert "[max]" in result.output and "[bands]" in result.output  # not eaten as rich markup
