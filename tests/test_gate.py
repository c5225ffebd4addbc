"""`probe gate`: exit codes 0/1/2, JSON and JUnit output, TOML limits."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
SMALL = dict(n_samples=10, prompt_len=(2, 5), response_len=(3, 9))


def gate(*args):
    return runner.invoke(app, ["gate", *[str(a) for a in args]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    spec = SyntheticSpec(
        **SMALL,
        score_sets=(
            ScoreSetSpec("loud", logprob_sigma=0.5, route_fraction=0.3),
            ScoreSetSpec("r3", route_fraction=0.0),
        ),
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("gate") / "run", spec)
    # No report yet: the first gate call computes it.
    assert gate(root, "--max", "k3_kl=100").exit_code == 0
    assert (root / "report" / "metrics.json").is_file()
    return root


def metrics_of(root):
    comps = json.loads((root / "report" / "metrics.json").read_text())["comparisons"]
    return {c["candidate"]: c["metrics"] for c in comps}


def test_exit_0_when_all_limits_hold(run):
    result = gate(run, "--max", "k3_kl=10", "--max", "extreme_fraction@2=1", "--max", "router_diff_rate=1")
    assert result.exit_code == 0, result.output
    assert result.output.count("pass") == 6 and "FAIL" not in result.output


def test_exit_1_when_a_limit_is_exceeded_json(run):
    loud = metrics_of(run)["scores/loud"]
    limit = loud["router_diff_rate"] / 2
    result = gate(run, "--max", f"router_diff_rate={limit}", "--max", "k3_kl=10", "--json")
    assert result.exit_code == 1
    out = json.loads(result.output)
    assert out["passed"] is False
    status = {(c["candidate"], c["metric"]): c["status"] for c in out["checks"]}
    assert status == {
        ("scores/loud", "router_diff_rate"): "fail",
        ("scores/loud", "k3_kl"): "pass",
        ("scores/r3", "router_diff_rate"): "pass",
        ("scores/r3", "k3_kl"): "pass",
    }
    fail = next(c for c in out["checks"] if c["status"] == "fail")
    assert fail["value"] == loud["router_diff_rate"] and fail["limit"] == limit


def test_pair_selects_comparisons(run):
    limit = metrics_of(run)["scores/loud"]["k3_kl"] / 2
    assert gate(run, "--max", f"k3_kl={limit}").exit_code == 1
    assert gate(run, "--max", f"k3_kl={limit}", "--pair", "rollout:r3").exit_code == 0
    result = gate(run, "--max", "k3_kl=1", "--pair", "r3:loud")
    assert (
        result.exit_code == 2 and "no comparison scores/r3:scores/loud (available: rollout:scores/loud" in result.output
    )


def test_junit_xml(run, tmp_path):
    limit = metrics_of(run)["scores/loud"]["k3_kl"] / 2
    path = tmp_path / "gate.xml"
    result = gate(run, "--max", f"k3_kl={limit}", "--max", "n_tokens=1e9", "--junit", path)
    assert result.exit_code == 1
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == "1" and suite.get("skipped") == "0"
    failed = [c for c in suite.iter("testcase") if c.find("failure") is not None]
    assert [(c.get("classname"), c.get("name")) for c in failed] == [("rollout vs scores/loud", "k3_kl")]
    assert "exceeds limit" in failed[0].find("failure").get("message")


def test_toml_limits_and_cli_override(run, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text('[max]\nk3_kl = 1e-12\n"extreme_fraction@2" = 1.0\n')
    assert gate(run, "--config", limits).exit_code == 1
    result = gate(run, "--config", limits, "--max", "k3_kl=10", "--json")
    assert result.exit_code == 0
    assert {c["metric"] for c in json.loads(result.output)["checks"]} == {"k3_kl", "extreme_fraction@2"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max", "nope=1"], "--max nope: unknown metric (valid keys: n_tokens, k3_kl, k1_kl"),
        (["--max", "k3_kl"], "--max 'k3_kl': expected KEY=VALUE"),
        (["--max", "k3_kl=abc"], "--max k3_kl: 'abc' is not a number"),
        (["--max", "extreme_fraction@3=1"], "no metric extreme_fraction@3 (thresholds computed: 1.5,2,5,10)"),
        ([], "no limits given"),
    ],
)
def test_unusable_input_exit_2(run, args, message):
    result = gate(run, *args)
    assert result.exit_code == 2 and message in result.output


def test_equivalent_threshold_spelling_is_accepted(run):
    assert gate(run, "--max", "extreme_fraction@2.0=1").exit_code == 0


def test_bad_toml_exit_2(run, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[max\nk3_kl = 1")
    result = gate(run, "--config", bad)
    assert result.exit_code == 2 and f"{bad}: not valid TOML" in result.output
    empty = tmp_path / "empty.toml"
    empty.write_text("k3_kl = 1\n")
    assert "expected a [max] table" in gate(run, "--config", empty).output
    assert f"{tmp_path / 'none.toml'}: file not found" in gate(run, "--config", tmp_path / "none.toml").output


def test_missing_run_exit_2(tmp_path):
    result = gate(tmp_path / "nowhere", "--max", "k3_kl=1")
    assert result.exit_code == 2 and "run directory not found" in result.output


def test_dense_routing_limits_are_skipped(tmp_path):
    root = write_synthetic_run(tmp_path / "dense", SyntheticSpec(num_layers=0, top_k=0, num_experts=0, **SMALL))
    result = gate(root, "--max", "router_diff_rate=0", "--max", "k3_kl=10", "--json")
    assert result.exit_code == 0, result.output
    checks = {c["metric"]: c for c in json.loads(result.output)["checks"]}
    assert checks["router_diff_rate"]["status"] == "skipped" and checks["router_diff_rate"]["value"] is None
    assert checks["k3_kl"]["status"] == "pass"


def test_junit_never_replaces_the_users_file(run, tmp_path):
    """--junit creates a file or replaces one probe gate wrote; anything else exits 2 before any work."""
    mine = tmp_path / "results.xml"
    mine.write_text("<testsuites><testsuite name='pytest'/></testsuites>")
    result = gate(run, "--max", "k3_kl=100", "--junit", mine)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().endswith(f"{mine}: not JUnit XML that probe gate wrote; refusing to replace it")
    assert mine.read_text() == "<testsuites><testsuite name='pytest'/></testsuites>"

    notes = tmp_path / "notes.txt"
    notes.write_text("not xml at all")
    assert gate(run, "--max", "k3_kl=100", "--junit", notes).exit_code == 2
    assert notes.read_text() == "not xml at all"

    folder = tmp_path / "folder"
    folder.mkdir()
    result = gate(run, "--max", "k3_kl=100", "--junit", folder)
    assert result.exit_code == 2 and "folder: exists and is not a file" in result.output
    assert folder.is_dir() and not any(folder.iterdir())


def test_junit_replaces_its_own_file_and_writes_through_a_link(run, tmp_path):
    ours = tmp_path / "gate.xml"
    assert gate(run, "--max", "k3_kl=100", "--junit", ours).exit_code == 0
    assert ET.parse(ours).getroot().find("testsuite").get("failures") == "0"
    limit = metrics_of(run)["scores/loud"]["k3_kl"] / 2
    assert gate(run, "--max", f"k3_kl={limit}", "--junit", ours).exit_code == 1
    assert ET.parse(ours).getroot().find("testsuite").get("failures") == "1"

    link = tmp_path / "link.xml"
    link.symlink_to(ours)
    assert gate(run, "--max", "k3_kl=100", "--junit", link).exit_code == 0
    assert link.is_symlink() and ET.parse(ours).getroot().find("testsuite").get("failures") == "0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.xml", "link.xml"]  # no temporary file left


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    """A matched set beside a diagnostic fp32 set whose k3 is far larger."""
    spec = SyntheticSpec(
        **SMALL,
        score_sets=(
            ScoreSetSpec("hf-bf16", logprob_sigma=0.05, role="matched"),
            ScoreSetSpec("hf-fp32", logprob_sigma=0.8, role="fp32"),
        ),
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("gate-roles") / "run", spec)
    assert gate(root, "--max", "k3_kl=100").exit_code == 0
    return root


def test_default_gates_the_matched_set_not_a_diagnostic_pass(diagnosed):
    k3 = {name: m["k3_kl"] for name, m in metrics_of(diagnosed).items()}
    assert k3["scores/hf-fp32"] > 10 * k3["scores/hf-bf16"]
    between = (k3["scores/hf-bf16"] * k3["scores/hf-fp32"]) ** 0.5
    result = gate(diagnosed, "--max", f"k3_kl={between}", "--json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)["checks"]
    assert {c["candidate"] for c in checks} == {"scores/hf-bf16"}
    assert result.stderr.strip() == (
        "gate: 1 comparison(s) of diagnostic score sets not gated (rollout:scores/hf-fp32); "
        "name one with --pair to gate it"
    )
    named = gate(diagnosed, "--max", f"k3_kl={between}", "--pair", "rollout:scores/hf-fp32")
    assert named.exit_code == 1 and "FAIL" in named.stdout


def test_a_run_of_diagnostic_sets_only_gates_them_all(tmp_path):
    spec = SyntheticSpec(**SMALL, score_sets=(ScoreSetSpec("hf-fp32", logprob_sigma=0.8, role="fp32"),))
    root = write_synthetic_run(tmp_path / "run", spec)
    result = gate(root, "--max", "k3_kl=1e-9")
    assert result.exit_code == 1 and "FAIL" in result.stdout and not result.stderr
