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

from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes

SAMPLES = 40


def test_killed_server_generate_resumes_without_loss_or_duplicates(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": FIXTURE_PROMPT}) for _ in range(SAMPLES)) + "\n")
    run = tmp_path / "run"
    with ReplayServer(sglang_routes(), delay_s=0.1) as server:
        cmd = [sys.executable, "-m", "mismatch_probe.cli", "generate", "--model", str(FIXTURE_MODEL),
               "--prompts", str(prompts), "--out", str(run), "--engine", "sglang", "--server-url", server.url,
               "--max-new-tokens", "5", "--temperature", "0", "--concurrency", "2"]
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
