"""The report's first screen and `probe report`'s stdout: the verdict, the summary table (one row per distinct
comparison, a word beside each k3), the bands it is judged against, what to do next, and the setup
findings of `probe doctor` in metrics.json."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from html import unescape

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report
from mismatch_probe.report.numbers import percent, times, with_interval
from mismatch_probe.report.render.page import render_index
from mismatch_probe.report.verdict.actions import next_actions
from mismatch_probe.report.verdict.bands import ACT, OK, PUBLISHED, WATCH, place, read_bands
from mismatch_probe.report.verdict.summary import distinct, headline_row, rows, verdict
from mismatch_probe.rundir.layout import Run
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

SPEC = SyntheticSpec(
    n_samples=16,
    prompt_len=(2, 5),
    response_len=(6, 14),
    score_sets=(
        ScoreSetSpec("bf16", logprob_sigma=0.05),
        ScoreSetSpec("r3", replay="r3", route_fraction=0.0),
        ScoreSetSpec("rep1", repeat_group="rep", pass_index=1),
        ScoreSetSpec("rep2", repeat_group="rep", pass_index=2),
    ),
)
FINDING = {
    "check": "prefix caching",
    "found": "the server reuses cached prefixes <b>across</b> requests",
    "cause": "vLLM's prefix caching is on",
    "fix": {
        "probe": "probe generate ... --engine-arg enable_prefix_caching=false",
        "verl": "actor_rollout_ref.rollout.enable_prefix_caching=False",
        "slime": None,
        "nemo_rl": "policy.generation.vllm_cfg.enable_prefix_caching=false",
    },
    "evidence": {"requests": 3},
}


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("verdict") / "run", SPEC)
    report = build_report(root)
    return root, report.metrics


def test_place_known_answers():
    moe, dense = True, False
    assert place(5e-4, [4e-4, 6e-4], None, PUBLISHED, moe).word == OK  # at most the acceptable 1e-3
    assert place(1.7e-3, [1.5e-3, 1.9e-3], None, PUBLISHED, moe).where == "in the MoE band"
    assert place(1.7e-3, [1.5e-3, 1.9e-3], None, PUBLISHED, moe).word == WATCH
    assert place(2e-3, None, None, PUBLISHED, dense).word == ACT  # above the dense band
    assert place(0.2, None, None, PUBLISHED, moe).where == "above the MoE band"
    # an interval reaching down into this run's noise floor: indistinguishable from rescoring noise
    floor = place(5e-3, [1e-3, 9e-3], [1e-4, 2e-3], PUBLISHED, moe)
    assert (floor.word, floor.where) == (OK, "at this run's noise floor")
    assert place(None, None, None, PUBLISHED, moe) is None


def test_identical_comparisons_are_one_row():
    same = {"n_tokens": 10, "k3_kl": 1e-3}
    comparisons = [
        {"reference": "rollout", "candidate": "scores/hf-bf16", "metrics": same},
        {"reference": "rollout", "candidate": "scores/hf-fp32", "metrics": {"n_tokens": 10, "k3_kl": 2e-3}},
        {"reference": "rollout", "candidate": "scores/rep-pass1", "metrics": dict(same)},
        {"reference": "scores/x", "candidate": "scores/rep-pass1", "metrics": dict(same)},  # another reference
    ]
    assert distinct(comparisons) == [[0, 2], [1], [3]]


def test_verdict_states_k3_band_routing_share_and_r3_cut(reported):
    root, metrics = reported
    run = Run(root)
    infos = run.side_infos()
    table = rows(metrics, infos, PUBLISHED, is_moe=True)
    assert len(table) == len(metrics["comparisons"])  # the synthetic sides all differ
    row = headline_row(table)
    assert row.names == [("rollout", "scores/bf16")]  # largest k3 of inference against unreplayed training
    share = metrics["attribution"]["routing_share"][0]
    m = metrics["comparisons"][0]["metrics"]
    expected = (
        f"Training and inference {'agree' if row.placement.word == OK else 'disagree'} ({row.placement.word}): "
        f"k3 {with_interval(m['k3_kl'], m['k3_kl_ci95'])}, {row.placement.where}; "
        f"routing explains {percent(share['share'], share['share_ci95'])}; "
        f"R3 cuts k3 {times(share['k3_kl_without_replay'] / share['k3_kl_with_replay'])} "
        "(rollout vs scores/bf16: no set is marked matched: the plain set at the rollout's dtype)."
    )
    assert verdict(metrics, table) == expected
    replayed = next(r for r in table if r.names == [("rollout", "scores/r3")])
    assert replayed.replayed and replayed.cells()[3] == "replayed"


def test_first_screen_and_next_actions_in_the_page(reported):
    root, metrics = reported
    run = Run(root)
    html = render_index(run, run.manifest(), metrics, [])
    first = html[html.index('<section id="verdict">') : html.index('<section id="next">')]
    text = unescape(re.sub(r"<[^>]+>", "", first))
    assert verdict(metrics, rows(metrics, run.side_infos(), PUBLISHED, True)) in text
    summary = re.search(r'<table class="summary">.*?<tbody>(.*?)</tbody>', first, re.S).group(1)
    assert summary.count("<tr>") == len(metrics["comparisons"])
    for word in re.findall(r'<span class="word (\w+)">(\w+)</span>', summary):
        assert word[0] == word[1] and word[0] in (OK, WATCH, ACT)  # the word is written, not only coloured
    actions = html[html.index('<section id="next">') : html.index('<section id="findings">')]
    assert "Replay the rollout&#x27;s routing in training (R3)" in actions
    assert f"probe rescore {root} --engine synthetic --dtype bf16 --replay r3" in actions
    assert "--use-rollout-routing-replay" in actions  # slime's setting


def test_a_setup_finding_comes_first_and_becomes_the_first_action(reported):
    root, metrics = reported
    run = Run(root)
    planted = copy.deepcopy(metrics) | {"findings": [FINDING]}
    html = render_index(run, run.manifest(), planted, [])
    first = html[html.index('<section id="verdict">') : html.index('<table class="summary">')]
    assert "prefix caching" in first and "&lt;b&gt;across&lt;/b&gt;" in first and "<b>across" not in html
    actions = next_actions(planted, None, run.side_infos(), root)
    assert [a.title for a in actions] == ["Fix the setup: prefix caching"]
    assert actions[0].how == {k: v for k, v in FINDING["fix"].items() if v}
    section = html[html.index('<section id="next">') : html.index('<section id="findings">')]
    assert section.index("Fix the setup: prefix caching") < section.index("(R3)")
    assert "actor_rollout_ref.rollout.enable_prefix_caching=False" in section and "NeMo-RL" in section


def test_bands_from_a_gate_toml(tmp_path, reported):
    root, _ = reported
    toml = tmp_path / "gate.toml"
    toml.write_text("[max]\nk3_kl = 1\n\n[bands]\nacceptable = 1e-9\nmoe = [1e-9, 1e-8]\n")
    bands = read_bands(toml)
    assert (bands.acceptable, bands.moe.low, bands.moe.high, bands.dense) == (1e-9, 1e-9, 1e-8, PUBLISHED.dense)
    result = CliRunner().invoke(app, ["report", str(root), "--bands", str(toml)])
    assert result.exit_code == 0, result.output
    assert "act: above the MoE band" in result.output  # every synthetic k3 now exceeds the tightened band
    gate = CliRunner().invoke(app, ["gate", str(root), "--config", str(toml)])
    assert gate.exit_code == 0, gate.output  # the gate reads [max] and accepts [bands] beside it


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("moe = [1e-3]", "[bands] moe: expected [low, high] with 0 < low < high"),
        ("acceptable = -1", "[bands] acceptable: expected a number above 0"),
        ("mixtral = [1e-3, 1e-2]", "[bands] mixtral: unknown band (known: acceptable, dense, moe, quantized)"),
    ],
)
def test_bad_bands_exit_2(tmp_path, reported, table, message):
    root, _ = reported
    toml = tmp_path / "bands.toml"
    toml.write_text(f"[bands]\n{table}\n")
    result = CliRunner().invoke(app, ["report", str(root), "--bands", str(toml)])
    assert result.exit_code == 2 and f"{toml}: {message}" in result.output


def test_terminal_prints_verdict_and_summary_on_stdout(reported):
    root, metrics = reported
    result = subprocess.run(
        [sys.executable, "-m", "mismatch_probe.cli", "report", str(root)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Training and inference") and "k3 KL [95% interval]" in result.stdout
    assert "rollout vs scores/bf16" in result.stdout and "verdict: where k3 sits" in result.stdout
    assert "Training and inference" not in result.stderr and "k3 KL [95%" not in result.stderr
    on_disk = json.loads((root / "report" / "metrics.json").read_text())
    assert set(on_disk) == set(metrics)  # the verdict adds no key to metrics.json
