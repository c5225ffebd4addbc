"""`probe CMD --help` shows boolean flags as flags: no `<bool>` type beside them, as if they took a value."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from mismatch_probe.cli import app

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

COMMANDS = typer.main.get_command(app).commands


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_flags_without_a_type(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "--help" in result.output
    # typer 0.29 writes `<bool>` beside its own --help (nothing public reaches it); every flag of ours has none.
    ours = [line for line in result.output.splitlines() if "<bool>" in line and "--help " not in line]
    assert not ours, ours


def test_no_private_typer_or_click_api_is_patched():
    import typer.core

    from mismatch_probe import help_flags

    source = open(help_flags.__file__).read()
    assert "typer.core" not in source and "TyperOption" not in source and "import click" not in source
    assert not getattr(typer.core.TyperOption, "flags_shown", False)


def test_gate_help_keeps_toml_table_names():
    result = CliRunner().invoke(app, ["gate", "--help"], env={"COLUMNS": "160"})
    assert "[max]" in result.output and "[bands]" in result.output  # not eaten as rich markup
