"""`probe generate --engine sglang-offline` runs on SGLang's own ServerArgs with the stand-in Engine of
tests/fake_sglang.py: a resumed run, and runs whose SGLang child process dies, told the way SGLang
tells it (SIGQUIT to the probe's process). Those run `probe` as a process (tests/standin_sglang_probe.py):
SGLang's own handler SIGKILLs the whole process, which must not be the test runner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (the Makefile installs it; the lowest CI lane does not)")

import fake_sglang
from fake_servers import FIXTURE_MODEL
from typer.testing import CliRunner

from mismatch_probe.cli import app

pytestmark = pytest.mark.slow  # probe killed by a dying engine child, then resumed

PROBE = [sys.executable, str(Path(__file__).with_name("standin_sglang_probe.py"))]
FAILED = "one of its processes failed (its error is printed above)"


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": [10 + i, 11, 12]}) for i in range(6)) + "\n")
    return path


def generate_args(prompts: Path, out: Path) -> list[str]:
    return [
        "generate",
        "--engine",
        "sglang-offline",
        "--model",
        str(FIXTURE_MODEL),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--dtype",
        "fp32",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "3",
        "--temperature",
        "0",
    ]


def probe(args: list[str], child_dies: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != fake_sglang.CHILD_DIES}
    if child_dies:
        env[fake_sglang.CHILD_DIES] = child_dies
    return subprocess.run(PROBE + args, capture_output=True, text=True, env=env, timeout=300)


def test_resume_keeps_the_recorded_dtype(monkeypatch, prompts, tmp_path):
    before = signal.getsignal(signal.SIGQUIT)
    fake_sglang.install(monkeypatch.setattr)
    out = tmp_path / "run"
    try:
        first = CliRunner().invoke(app, generate_args(prompts, out))
        assert first.exit_code == 0, first.output
        resumed = CliRunner().invoke(app, generate_args(prompts, out) + ["--resume"])
        assert resumed.exit_code == 0, resumed.output
    finally:
        signal.signal(signal.SIGQUIT, before)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "fp32" and manifest["engine"]["engine_args"]["dtype"] == "float32"
    assert manifest["status"] == "complete"


def test_child_dying_mid_run_is_one_line_and_resume_continues(prompts, tmp_path):
    out = tmp_path / "run"
    # Call 1 is the readiness probe, calls 2-4 the windows of samples 0-1, 2-3, 4-5: the second window dies.
    died = probe(generate_args(prompts, out), child_dies="3")
    assert died.returncode == 1, died.stderr
    assert "Scheduler hit an exception" in died.stderr and "Traceback" not in died.stderr
    assert died.stderr.strip().splitlines()[-1] == (
        f"error: SGLang Engine died: {FAILED}; finished parts are kept: re-run with --resume to continue"
    )
    [part] = sorted((out / "rollout").glob("part-*.parquet"))
    written = pq.read_table(part).to_pydict()
    assert sorted(set(written["sample_id"])) == [0, 1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["completed_samples"], manifest["dtype"]) == ("running", 2, "fp32")

    resumed = probe(generate_args(prompts, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr
    table = pl.read_parquet(out / "rollout" / "*.parquet")
    assert sorted(table["sample_id"].unique()) == list(range(6))
    assert table.select("sample_id", "position").is_duplicated().sum() == 0
    assert pq.read_table(part).to_pydict() == written  # the part written before the death is untouched
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


def test_child_dying_while_the_engine_starts_is_one_line(prompts, tmp_path):
    out = tmp_path / "run"
    died = probe(generate_args(prompts, out), child_dies="start")
    assert died.returncode == 1, died.stderr
    assert "Traceback" not in died.stderr
    assert died.stderr.strip().splitlines()[-1] == (
        f"error: SGLang Engine died while starting: {FAILED}; --help-engine sglang-offline lists settings known to "
        "work on CPU"
    )
    assert not out.exists()  # nothing written: nothing left behind
