"""A run killed with SIGKILL mid-way and resumed equals an uninterrupted run: nothing lost, nothing doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

pytestmark = pytest.mark.slow  # generate and rescore killed and resumed in subprocesses

PROBE = [sys.executable, "-m", "mismatch_probe.cli"]
SAMPLES = 48


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("kill") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": [3 + i % 50, 7, 9 + i % 7]}) for i in range(SAMPLES // 2)))
    return path


def _kill_after_parts(cmd: list[str], parts_dir: Path, min_parts: int, total: int) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while len(list(parts_dir.glob("part-*.parquet"))) < min_parts:
        assert proc.poll() is None, "finished before it could be killed"
        assert time.time() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(list(parts_dir.glob("part-*.parquet"))) < total, "the kill came too late to test anything"


def _table(directory: Path) -> pl.DataFrame:
    return pl.read_parquet(directory / "*.parquet")


def test_generate_and_rescore_survive_sigkill(tiny_moe, prompts, tmp_path):
    gen = [
        "generate",
        "--model",
        str(tiny_moe),
        "--prompts",
        str(prompts),
        "--samples-per-prompt",
        "2",
        "--max-new-tokens",
        "24",
        "--batch-size",
        "2",
        "--seed",
        "5",
        "--out",
    ]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(PROBE + gen + [str(reference)], check=True, capture_output=True)

    _kill_after_parts(PROBE + gen + [str(killed)], killed / "rollout", 3, SAMPLES // 2)
    assert json.loads((killed / "manifest.json").read_text())["status"] == "running"
    subprocess.run(PROBE + gen + [str(killed), "--resume"], check=True, capture_output=True)
    resumed = _table(killed / "rollout")
    assert (
        resumed["sample_id"].n_unique() == SAMPLES
        and resumed.select("sample_id", "position").is_duplicated().sum() == 0
    )
    assert resumed.equals(_table(reference / "rollout"))
    assert json.loads((killed / "manifest.json").read_text())["completed_samples"] == SAMPLES

    rescore = ["rescore", "--dtype", "fp32", "--batch-size", "1"]
    subprocess.run(PROBE + rescore + [str(reference)], check=True, capture_output=True)
    _kill_after_parts(PROBE + rescore + [str(killed)], killed / "scores" / "hf-fp32", 3, SAMPLES // 2)
    subprocess.run(PROBE + rescore + [str(killed), "--resume"], check=True, capture_output=True)
    assert _table(killed / "scores" / "hf-fp32").equals(_table(reference / "scores" / "hf-fp32"))
