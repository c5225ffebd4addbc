"""`probe gate --use-ci-upper` and `--baseline`: noise-aware checks with intervals in every output."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()


def gate(*args):
    return runner.invoke(app, ["gate", *[str(a) for a in args]])


def _run(root, sigma: float, seed: int):
    spec = SyntheticSpec(
        n_samples=60,
        response_len=(8, 40),
        seed=seed,
        score_sets=(ScoreSetSpec("bf16", logprob_sigma=sigma, route_fraction=0.02),),
    )
    return write_synthetic_run(root, spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gate-stats")
    return {
        "baseline": _run(base / "baseline", 0.05, seed=1),
        "noise": _run(base / "noise", 0.05, seed=2),  # the same setup sampled again
        "regressed": _run(base / "regressed", 0.08, seed=3),  # planted: 1.6x the log-prob noise
    }


def _metrics(root):
    return json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]


def test_a_run_against_itself_passes(runs):
    result = gate(runs["baseline"], "--baseline", runs["baseline"], "--json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.output)["checks"]
    assert {c["metric"] for c in checks} >= {"k3_kl", "router_diff_rate", "chi2_seq", "tis_clip_fraction@2"}
    assert all(c["status"] == "pass" and c["checked"] == "baseline" for c in checks)


def test_a_fresh_sample_of_the_same_setup_passes(runs):
    result = gate(runs["noise"], "--baseline", runs["baseline"])
    assert result.exit_code == 0, result.output


def test_a_planted_regression_fails_with_intervals_in_json_and_junit(runs, tmp_path):
    junit = tmp_path / "gate.xml"
    result = gate(runs["regressed"], "--baseline", runs["baseline"], "--max", "k3_kl=1", "--json", "--junit", junit)
    assert result.exit_code == 1, result.output
    checks = {(c["metric"], c["checked"]): c for c in json.loads(result.output)["checks"]}
    assert set(checks) == {("k3_kl", "value"), ("k3_kl", "baseline")}  # --max names the key compared
    regressed, base = _metrics(runs["regressed"]), _metrics(runs["baseline"])
    check = checks[("k3_kl", "baseline")]
    assert check["status"] == "fail" and checks[("k3_kl", "value")]["status"] == "pass"
    assert check["value"] == regressed["k3_kl"] and check["ci95"] == regressed["k3_kl_ci95"]
    assert check["baseline"] == base["k3_kl"] and check["baseline_ci95"] == base["k3_kl_ci95"]
    assert check["ci95"][0] > check["baseline_ci95"][1] == check["limit"]
    case = ET.parse(junit).getroot().find(".//testcase[@name='k3_kl vs baseline']")
    props = {p.get("name"): float(p.get("value")) for p in case.iter("property") if p.get("name") != "checked"}
    assert props["ci95_low"] == check["ci95"][0] and props["baseline_ci95_high"] == check["baseline_ci95"][1]
    assert props["baseline"] == check["baseline"]
    assert "do not overlap" in case.find("failure").get("message")


def test_use_ci_upper_checks_the_upper_end(runs):
    m = _metrics(runs["baseline"])
    limit = (m["k3_kl"] + m["k3_kl_ci95"][1]) / 2  # above the point, below the interval's upper end
    assert gate(runs["baseline"], "--max", f"k3_kl={limit}").exit_code == 0
    result = gate(
        runs["baseline"], "--max", f"k3_kl={limit}", "--max", "abs_logprob_diff_max=10", "--use-ci-upper", "--json"
    )
    assert result.exit_code == 1
    checks = {c["metric"]: c for c in json.loads(result.output)["checks"]}
    assert checks["k3_kl"]["status"] == "fail" and checks["k3_kl"]["checked"] == "ci95_upper"
    assert checks["k3_kl"]["ci95"] == m["k3_kl_ci95"]
    # a key without an interval is checked on its value
    assert checks["abs_logprob_diff_max"]["checked"] == "value" and checks["abs_logprob_diff_max"]["status"] == "pass"


def test_baseline_without_intervals_exit_2(runs, tmp_path):
    old = _run(tmp_path / "old", 0.05, seed=1)
    assert gate(old, "--max", "k3_kl=1").exit_code == 0
    path = old / "report" / "metrics.json"
    data = json.loads(path.read_text())
    data["comparisons"][0]["metrics"].pop("k3_kl_ci95")
    path.write_text(json.dumps(data))
    result = gate(runs["baseline"], "--baseline", old, "--max", "k3_kl=1")
    assert result.exit_code == 2
    assert f"{path}: rollout vs scores/bf16: k3_kl has no k3_kl_ci95 interval" in result.output.replace("\n", "")
