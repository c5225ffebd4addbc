"""`probe keys`: the key rosetta from the catalogue, as a table, the README's markdown, or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mismatch_probe.report.keys.catalogue import CATALOGUE
from mismatch_probe.report.keys.metric_key import PEERS
from mismatch_probe.report.keys.rosetta import markdown

ROOT = Path(__file__).resolve().parents[1]


def _probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "mismatch_probe.cli", "keys", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_json_gives_every_key_and_each_peer_s_name_or_none():
    done = _probe("--format", "json")
    assert done.returncode == 0, done.stderr
    rows = {row["key"]: row for row in json.loads(done.stdout)}
    assert list(rows) == [entry.name for entry in CATALOGUE]
    assert rows["log_ppl_diff"]["verl"] == "rollout_corr/log_ppl_diff"
    assert rows["is_ess@C"]["verl"] == (
        "rollout_corr/rollout_is_eff_sample_size (rollout_is: token, rollout_is_threshold: C)"
    )
    assert rows["is_ess"]["verl"] == "none" and "is_ess@C" in rows["is_ess"]["note"]
    assert rows["mult_prob_error"]["NeMo-RL"] == "token_mult_prob_error"
    assert rows["k3_kl"]["prime-rl"] == "mismatch_kl/all/mean" and rows["k3_kl"]["slime/miles"] == "none"
    assert rows["k2_kl"]["prime-rl"] == "none"
    assert all(set(PEERS) <= set(row) for row in rows.values())


def test_markdown_is_the_docs_key_table_and_the_table_names_the_peers():
    done = _probe("--format", "markdown")
    assert done.returncode == 0 and done.stdout.strip() == markdown()
    assert "<!-- keys:begin -->\n" + markdown() + "\n<!-- keys:end -->" in (ROOT / "docs" / "metrics.md").read_text()
    table = _probe()
    assert table.returncode == 0
    assert all(peer in table.stdout for peer in PEERS) and "rollout_corr/chi2_seq" in table.stdout


def test_an_unknown_format_is_one_line_and_exit_2():
    done = _probe("--format", "yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--format: 'yaml' is not one of table, markdown, json")
    assert "Traceback" not in done.stderr
