"""A run remembers what its report was asked for: a plain `probe report RUN` reproduces it, `--pair +A:B`
adds a pair, `--pair A:B` replaces them, and every hint's command gives the same report plus the change."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report
from mismatch_probe.rundir.layout import Run
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()
SIDES = (
    ScoreSetSpec("hf-bf16", engine="hf", dtype="bf16", logprob_sigma=0.05),
    ScoreSetSpec("mg-bf16", engine="megatron", dtype="bf16", logprob_sigma=0.05),
)
SPEC = SyntheticSpec(
    num_layers=0, top_k=0, num_experts=0, n_samples=8, prompt_len=(2, 4), response_len=(3, 8), score_sets=SIDES
)
GAP = ("scores/hf-bf16", "scores/mg-bf16")
DEFAULTS = [("rollout", "scores/hf-bf16"), ("rollout", "scores/mg-bf16")]


def probe(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def written(root) -> dict:
    return json.loads((root / "report" / "metrics.json").read_text())


def pairs_of(root) -> list[tuple[str, str]]:
    return [(c["reference"], c["candidate"]) for c in written(root)["comparisons"]]


def hint_commands(root) -> list[str]:
    """The `probe report ...` commands the report's missing lines print."""
    return [
        cmd for line in written(root)["attribution"]["missing"] for cmd in re.findall(r"`(probe report [^`]*)`", line)
    ]


def run_hint(command: str):
    return probe(*shlex.split(command)[1:])


@pytest.fixture
def run(tmp_path):
    return write_synthetic_run(tmp_path / "run", SPEC)


def test_a_plain_rerun_keeps_the_pairs_the_report_was_asked_for(run):
    # As the demo builds its report: the default pairs and an engine pair.
    build_report(run, pairs=Run(run).default_pairs() + [GAP], render=False)
    assert pairs_of(run) == DEFAULTS + [GAP]
    build_report(run, render=False)
    assert pairs_of(run) == DEFAULTS + [GAP]
    probe("report", run)
    assert pairs_of(run) == DEFAULTS + [GAP]


def test_plus_adds_to_the_defaults_and_a_plain_pair_replaces_them(run):
    result = probe("report", run, "--pair", f"+{GAP[0]}:{GAP[1]}", "--thresholds", "1.5,3")
    assert pairs_of(run) == DEFAULTS + [GAP]
    request = written(run)["request"]
    assert request == {
        "default_pairs": True,
        "pairs": ["scores/hf-bf16:scores/mg-bf16"],
        "thresholds": ["1.5", "3"],
        "routing_scope": "all",
        "tis_caps": ["2", "5"],
        "geo_bounds": ["1.001", "1.01"],
        "worst": 20,
        "drift_ratio": 1.5,
        "ppo_bounds": ["below@0.8", "above@1.2", "above@1.27"],
    }
    assert "as the last report" not in result.output  # everything was asked for
    # A plain rerun: the same pairs and thresholds, and the summary says where they came from.
    result = probe("report", run)
    assert pairs_of(run) == DEFAULTS + [GAP] and written(run)["request"] == request
    assert "extreme_fraction@3" in written(run)["comparisons"][0]["metrics"]
    assert (
        "note: as the last report of this run: --pair +scores/hf-bf16:scores/mg-bf16 --thresholds 1.5,3"
        in result.output.replace("\n", "")
    )
    # A plain pair replaces; the run remembers that too, and other options given replace theirs only.
    probe("report", run, "--pair", "rollout:hf-bf16", "--thresholds", "2")
    assert pairs_of(run) == [("rollout", "scores/hf-bf16")]
    probe("report", run)
    assert pairs_of(run) == [("rollout", "scores/hf-bf16")]
    assert written(run)["request"]["default_pairs"] is False and written(run)["request"]["thresholds"] == ["2"]
    # +A:B adds to the remembered pairs, not to the defaults.
    probe("report", run, "--pair", "+rollout:mg-bf16")
    assert pairs_of(run) == DEFAULTS


def test_the_engine_gap_hint_reproduces_the_report_plus_the_pair(run):
    probe("report", run, "--thresholds", "1.5,3", "--routing-scope", "response")
    before = pairs_of(run)
    (command,) = hint_commands(run)
    assert command == f"probe report {run} --pair +scores/hf-bf16:scores/mg-bf16"
    run_hint(command)
    assert pairs_of(run) == before + [GAP]
    request = written(run)["request"]
    assert request["thresholds"] == ["1.5", "3"] and request["routing_scope"] == "response"
    assert [(g["reference"], g["candidate"]) for g in written(run)["attribution"]["engine_gap"]][-1] == GAP
    assert hint_commands(run) == []  # the gap is stated now


def test_a_rescore_hint_after_replaced_pairs_names_the_pairs_to_add(run, tmp_path):
    probe("report", run, "--pair", "rollout:hf-bf16")
    line = next(m for m in written(run)["attribution"]["missing"] if "noise floor of hf" in m)
    p1, p2 = "scores/hf-bf16-pass1", "scores/hf-bf16-pass2"
    assert line == (
        f"add `probe rescore {run} --engine hf --dtype bf16 --repeats 2`, then `probe report {run} "
        f"--pair +rollout:{p1} --pair +rollout:{p2} --pair +{p1}:{p2}` for the noise floor of hf "
        "training at bf16 (pass against pass)"
    )
    # What the rescore would write: the same rollout (same seed) with the two passes, copied into the run.
    passes = tuple(
        ScoreSetSpec(p.removeprefix("scores/"), engine="hf", dtype="bf16", repeat_group="hf-bf16", pass_index=i)
        for i, p in enumerate((p1, p2), 1)
    )
    twin = write_synthetic_run(tmp_path / "twin", replace(SPEC, score_sets=SIDES + passes))
    for side in (p1, p2):
        shutil.copytree(twin / side, run / side)
    (command,) = [c for c in hint_commands(run) if p1 in c]
    run_hint(command)
    assert pairs_of(run) == [("rollout", "scores/hf-bf16"), ("rollout", p1), ("rollout", p2), (p1, p2)]
    assert [(e["reference"], e["candidate"]) for e in written(run)["attribution"]["noise_floor"]] == [(p1, p2)]


def test_the_gate_hint_adds_the_missing_pair(run):
    probe("report", run, "--thresholds", "1.5,3")
    result = runner.invoke(app, ["gate", str(run), "--max", "k3_kl=10", "--pair", "hf-bf16:mg-bf16"])
    assert result.exit_code == 2
    command = re.search(r"add it with `(probe report [^`]*)`", result.output.replace("\n", "")).group(1)
    assert command == f"probe report {run} --pair +scores/hf-bf16:scores/mg-bf16"
    run_hint(command)
    assert pairs_of(run) == DEFAULTS + [GAP] and written(run)["request"]["thresholds"] == ["1.5", "3"]
    probe("gate", run, "--max", "k3_kl=10", "--pair", "hf-bf16:mg-bf16")


def test_a_remembered_pair_whose_side_is_gone_is_refused(run):
    probe("report", run, "--pair", f"+{GAP[0]}:{GAP[1]}")
    shutil.rmtree(run / "scores" / "mg-bf16")
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 2
    assert (
        f"{run}/report/metrics.json: remembered pair scores/hf-bf16:scores/mg-bf16: {run}/scores/mg-bf16: no such side"
    ) in result.output.replace("\n", "")
    probe("report", run, "--pair", "rollout:hf-bf16")  # a pair given replaces the remembered ones


def test_a_damaged_request_falls_back_to_the_defaults(run):
    probe("report", run, "--pair", "rollout:hf-bf16")
    path = run / "report" / "metrics.json"
    for damaged in ({"pairs": [3]}, {"pairs": "rollout:hf-bf16"}, {"worst": -1}, "all"):
        path.write_text(json.dumps(written(run) | {"request": damaged}))
        probe("report", run)
        assert pairs_of(run) == DEFAULTS
