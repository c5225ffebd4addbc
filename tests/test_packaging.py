"""What an installed package must offer: its version, `python -m`, the demo data, and the [megatron] extra's message."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mismatch_probe
from mismatch_probe.cli import app
from mismatch_probe.engines.extras import engine_installed
from mismatch_probe.pipeline.demo import run as demo

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
MISSING_MEGATRON = (
    "error: --engine megatron needs megatron-core, which is not installed: pip install 'mismatch-probe[megatron]'"
)


@pytest.fixture
def without_megatron(monkeypatch):
    """As if megatron-core were not installed: a None entry in sys.modules makes its import fail."""
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, None)


def test_version_is_the_distributions():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"mismatch-probe {mismatch_probe.__version__}\n"
    assert version("mismatch-probe") == mismatch_probe.__version__


def test_python_m_is_probe():
    out = subprocess.run(
        [sys.executable, "-m", "mismatch_probe", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout == f"mismatch-probe {mismatch_probe.__version__}\n"
    helped = subprocess.run(
        [sys.executable, "-m", "mismatch_probe", "rescore", "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and "Usage: probe rescore" in helped.stdout, helped.stdout + helped.stderr


def test_demo_data_is_package_data():
    assert demo.DATA == Path(mismatch_probe.__file__).parent / "data"
    for kind in ("moe", "dense"):
        assert (demo.DATA / "models" / kind / "config.json").is_file()
        assert (demo.DATA / "models" / kind / "model.safetensors").is_file()
    assert (demo.DATA / "prompts" / "demo.jsonl").is_file()


def test_megatron_is_found_when_installed():
    # The test environment installs the [megatron] extra (Makefile), so a False here is a broken lookup.
    assert engine_installed("megatron")
    assert engine_installed("hf") and engine_installed("sglang") and engine_installed("vllm")


@pytest.fixture
def scored_run(tmp_path, tiny_moe) -> Path:
    """A real rollout of the tiny MoE model with one transformers score set, 'kept'."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [3, 4, 5]}\n{"input_ids": [6, 7]}\n')
    run = tmp_path / "run"
    for args in (
        ["generate", "--model", tiny_moe, "--prompts", prompts, "--out", run, "--max-new-tokens", 3],
        ["rescore", run, "--engine", "hf", "--name", "kept"],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return run


def test_rescore_megatron_without_extra_names_the_install_command(scored_run, without_megatron):
    kept = sorted(p.name for p in (scored_run / "scores" / "kept").iterdir())
    result = runner.invoke(app, ["rescore", str(scored_run), "--engine", "megatron"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.output.splitlines() == [MISSING_MEGATRON]
    assert not (scored_run / "scores" / "megatron-fp32").exists()
    # Refused before --overwrite clears anything.
    result = runner.invoke(app, ["rescore", str(scored_run), "--engine", "megatron", "--name", "kept", "--overwrite"])
    assert result.output.splitlines() == [MISSING_MEGATRON]
    assert sorted(p.name for p in (scored_run / "scores" / "kept").iterdir()) == kept


def test_demo_without_megatron_runs_the_transformers_steps(without_megatron):
    plan, engine_pairs = demo._installed_plan()
    assert plan == tuple(step for step in demo.PLAN if step.engine == "hf")
    assert engine_pairs == ()


def test_demo_with_megatron_runs_every_step():
    assert demo._installed_plan() == (demo.PLAN, demo.ENGINE_PAIRS)
