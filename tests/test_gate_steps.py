"""`probe gate --max-drift R` (a rise over a run's steps) and `--history DIR` (the run against earlier runs
of the same setup), issue 34."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.record import Recorder
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()


def gate(*args):
    return runner.invoke(app, ["gate", *[str(a) for a in args]])


def record_run(root, sigma_of_step, seed: int = 0, steps: int = 30):
    rng = np.random.default_rng(seed)
    with Recorder(root) as rec:
        for step in range(steps):
            for _ in range(6):
                lp = rng.uniform(-4.0, -0.05, 30)
                noisy = np.minimum(lp + rng.normal(0.0, sigma_of_step(step), 30), 0.0)
                rec.add([1, 2], rng.integers(0, 100, 30), lp, noisy, step=step)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gate-steps")
    return {
        "flat": record_run(base / "flat", lambda s: 0.05),
        "jump": record_run(base / "jump", lambda s: 0.05 * (math.sqrt(5) if s >= 12 else 1), seed=1),
        "fixed": record_run(base / "fixed", lambda s: 0.1 if s < 12 else 0.03, seed=2),
    }


def test_a_rise_beyond_the_limit_fails_and_names_its_step(runs, tmp_path):
    junit = tmp_path / "gate.xml"
    result = gate(runs["jump"], "--max-drift", "2", "--json", "--junit", junit)
    assert result.exit_code == 1, result.output
    (check,) = json.loads(result.output)["checks"]
    assert check["status"] == "fail" and check["checked"] == "drift" and 11 <= check["step"] <= 13
    assert check["ci95"][0] > 2
    message = ET.parse(junit).getroot().find(".//testcase[@name='drift']/failure").get("message")
    assert message.startswith("k3 rose ") and f"from step {check['step']}" in message
    assert gate(runs["jump"], "--max-drift", "20").exit_code == 0  # x5 is not beyond x20


def test_a_flat_run_and_a_drop_pass(runs):
    assert gate(runs["flat"], "--max-drift", "1.5").exit_code == 0
    result = gate(runs["fixed"], "--max-drift", "1.5", "--json")
    assert result.exit_code == 0, result.output
    (check,) = json.loads(result.output)["checks"]
    assert check["status"] == "pass" and check["value"] < 1  # a drop was found, and does not fail


def test_max_drift_on_a_run_without_steps_is_exit_2(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(n_samples=20))
    result = gate(root, "--max-drift", "2")
    assert result.exit_code == 2 and "no per-step metrics" in result.output
    assert gate(root, "--max-drift", "0.5").exit_code == 2


def _synthetic(root, sigma: float, seed: int):
    spec = SyntheticSpec(
        n_samples=60,
        response_len=(8, 40),
        seed=seed,
        score_sets=(ScoreSetSpec("bf16", logprob_sigma=sigma, route_fraction=0.02),),
    )
    return write_synthetic_run(root, spec)


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    base = tmp_path_factory.mktemp("history")
    return {
        "earlier": [_synthetic(base / f"h{i}", 0.05, seed=10 + i) for i in range(3)],
        "same": _synthetic(base / "same", 0.05, seed=20),
        "regressed": _synthetic(base / "regressed", 0.1, seed=21),
    }


def _history_args(runs):
    return [arg for run in runs for arg in ("--history", run)]


def test_a_run_like_its_history_passes_and_a_regression_fails(history):
    result = gate(history["same"], *_history_args(history["earlier"]), "--json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.output)["checks"]
    assert {c["metric"] for c in checks} == {"k3_kl", "extreme_fraction@2"}
    assert all(c["checked"] == "history" for c in checks)
    result = gate(history["regressed"], *_history_args(history["earlier"]), "--json")
    assert result.exit_code == 1, result.output
    k3 = next(c for c in json.loads(result.output)["checks"] if c["metric"] == "k3_kl")
    assert k3["status"] == "fail" and k3["ci95"][0] > k3["limit"]


def test_history_checks_the_max_keys(history):
    result = gate(history["regressed"], *_history_args(history["earlier"]), "--max", "k3_kl=1", "--json")
    checks = {(c["metric"], c["checked"]) for c in json.loads(result.output)["checks"]}
    assert checks == {("k3_kl", "value"), ("k3_kl", "history")}


def test_too_little_history_says_so_and_fails_only_under_strict(history):
    few = _history_args(history["earlier"][:2])
    result = gate(history["regressed"], *few)
    assert result.exit_code == 0, result.output
    assert "2 runs given, at least 3 are needed" in result.output.replace("\n", " ")
    assert gate(history["regressed"], *few, "--strict").exit_code == 1


def test_max_drift_below_the_reports_ratio_judges_the_change_point_itself(tmp_path):
    root = record_run(tmp_path / "run", lambda s: 0.05 * (math.sqrt(1.4) if s >= 15 else 1), seed=3)
    assert gate(root, "--max-drift", "3").exit_code == 0
    comparison = json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]
    assert comparison["drift"] is None  # x1.4 is below the report's 1.5
    assert comparison["change_point"]["ratio_ci95"][0] > 1.2 and 14 <= comparison["change_point"]["step"] <= 16
    result = gate(root, "--max-drift", "1.2", "--json")
    assert result.exit_code == 1, result.output
