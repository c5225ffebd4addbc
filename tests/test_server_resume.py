"""A `probe generate --engine sglang` killed with SIGKILL mid-run resumes with every sample exactly once.

The server is a local replay of recorded SGLang 0.5.23 output (tests/fake_servers.py), slowed down
so that the kill lands between part files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import polars as pl
import pytest
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes

SAMPLES = 40


@pytest.mark.slow  # a server killed mid-run, then generate resumed
def test_killed_server_generate_resumes_without_loss_or_duplicates(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": FIXTURE_PROMPT}) for _ in range(SAMPLES)) + "\n")
    run = tmp_path / "run"
    with ReplayServer(sglang_routes(), delay_s=0.1) as server:
        cmd = [
            sys.executable,
            "-m",
            "mismatch_probe.cli",
            "generate",
            "--model",
            str(FIXTURE_MODEL),
            "--prompts",
            str(prompts),
            "--out",
            str(run),
            "--engine",
            "sglang",
            "--server-url",
            server.url,
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
            "--concurrency",
            "2",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while not list((run / "rollout").glob("part-*.parquet")):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        finished = len(list((run / "rollout").glob("part-*.parquet")))
        assert 0 < finished < SAMPLES // 8  # windows of concurrency x 4 = 8 samples
        assert json.loads((run / "manifest.json").read_text())["status"] == "running"

        done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    table = pl.read_parquet(run / "rollout")
    assert sorted(table["sample_id"].unique().to_list()) == list(range(SAMPLES))
    assert table.select("sample_id", "position").is_duplicated().sum() == 0
    assert (table.group_by("sample_id").len()["len"] == 25).all()  # 20 prompt + 5 response tokens each
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["completed_samples"] == SAMPLES


# ---- a server error ends generate --------------------------------------------------------------


def _refusing(routes: dict, allowed: int) -> dict:
    """SGLang routes whose /generate refuses the fixture prompt (HTTP 400, as for a prompt that is too
    long) after `allowed` answers; the engine's short readiness prompt is always answered."""
    generate = routes["/generate"]
    answered = []

    def refuse(body, server):
        if body["input_ids"] == FIXTURE_PROMPT:
            if len(answered) >= allowed:
                return 400, {"error": {"message": "The input (20 tokens) is longer than the model's context length"}}
            answered.append(1)
        return generate(body, server)

    return {**routes, "/generate": refuse}


def _generate(run, url: str, samples: int, *extra: str):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    prompts = run.parent / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": FIXTURE_PROMPT}) for _ in range(samples)) + "\n")
    return CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(FIXTURE_MODEL),
            "--prompts",
            str(prompts),
            "--out",
            str(run),
            "--engine",
            "sglang",
            "--server-url",
            url,
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
            "--concurrency",
            "2",
            *extra,
        ],
    )


@pytest.mark.parametrize("existing_folder", [False, True])
def test_failure_before_any_sample_leaves_nothing_to_overwrite(tmp_path, existing_folder):
    run = tmp_path / "run"
    if existing_folder:
        run.mkdir()
    with ReplayServer(_refusing(sglang_routes(), allowed=0)) as server:
        result = _generate(run, server.url, 3)
    assert result.exit_code == 1 and "(HTTP 400: " in result.output, result.output
    assert (list(run.iterdir()) == []) if existing_folder else not run.exists()
    with ReplayServer(sglang_routes()) as server:
        result = _generate(run, server.url, 3)  # a retry needs neither --overwrite nor --resume
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(run / "rollout").height == 3 * 25


def test_failure_after_finished_samples_keeps_them_for_resume(tmp_path):
    run = tmp_path / "run"
    with ReplayServer(_refusing(sglang_routes(), allowed=8)) as server:  # one window: concurrency 2 x 4 samples
        result = _generate(run, server.url, 12)
    assert result.exit_code == 1, result.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "running" and manifest["completed_samples"] == 8
    with ReplayServer(sglang_routes()) as server:
        result = _generate(run, server.url, 12, "--resume")
        assert len(server.calls_to("/generate")) == 1 + 4  # the readiness probe, then only the 4 missing samples
    assert result.exit_code == 0, result.output
    assert sorted(pl.read_parquet(run / "rollout")["sample_id"].to_list()) == sorted(list(range(12)) * 25)
