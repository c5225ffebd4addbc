"""`probe gate` refuses verdicts that mean nothing: a gate that compares nothing, a metrics.json of another
schema version, unusable limits and unknown keys; it warns about (or, with --strict, refuses) a baseline
of another kind of run; and it counts the failed checks."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()
SMALL = dict(n_samples=16, prompt_len=(2, 5), response_len=(4, 12))
BF16, LOUD = ScoreSetSpec("bf16", logprob_sigma=0.05), ScoreSetSpec("loud", logprob_sigma=0.5)


def gate(*args):
    return runner.invoke(app, ["gate", *[str(a) for a in args]])


def one_line(result) -> str:
    return result.output.replace("\n", "")


def _reported(root, **spec):
    root = write_synthetic_run(root, SyntheticSpec(**SMALL, **spec))
    assert gate(root, "--max", "k3_kl=100").exit_code == 0
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("trust")
    return {
        "run": _reported(base / "run", score_sets=(BF16, LOUD)),
        # The same seed: the same rollout and bf16/loud sides, and one side more.
        "wider": _reported(base / "wider", score_sets=(BF16, LOUD, ScoreSetSpec("r3", route_fraction=0.0))),
        "other": _reported(base / "other", score_sets=(ScoreSetSpec("other"),)),
        "dense": _reported(base / "dense", num_layers=0, top_k=0, num_experts=0, score_sets=(BF16,)),
    }


def _copy(runs, tmp_path, name: str):
    return shutil.copytree(runs["run"], tmp_path / name)


def _edit(path, **changes):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | changes))


# ---- a gate that compares nothing --------------------------------------------------------------------


def test_a_baseline_with_no_comparison_in_common_exit_2(runs):
    run, other = runs["run"], runs["other"]
    for extra in ([], ["--max", "k3_kl=10"], ["--json"]):
        result = gate(run, "--baseline", other, *extra)
        assert result.exit_code == 2, result.output
        assert (
            f"error: gate compares nothing against the baseline: no comparison of {run} has a value in both "
            f"runs (run {run}: rollout:scores/bf16, rollout:scores/loud; baseline {other}: rollout:scores/other)"
            in one_line(result)
        )


def test_a_pair_the_baseline_lacks_exit_2(runs):
    wider, run = runs["wider"], runs["run"]
    assert gate(wider, "--baseline", run).exit_code == 0  # bf16 and loud compared; r3 skipped
    result = gate(wider, "--baseline", run, "--pair", "rollout:r3")
    assert result.exit_code == 2
    assert (
        f"no comparison of {wider} has a value in both runs (run {wider}: rollout:scores/r3; baseline {run}: "
        "rollout:scores/bf16, rollout:scores/loud)"
    ) in one_line(result)


def test_a_metrics_json_without_comparisons_exit_2(runs, tmp_path):
    empty = _copy(runs, tmp_path, "empty")
    _edit(empty / "report" / "metrics.json", comparisons=[])
    result = gate(empty, "--baseline", runs["run"])
    assert result.exit_code == 2
    assert (
        f"gate compares nothing against the baseline: no comparison of {empty} has a value in both runs "
        f"(run {empty}: none; baseline {runs['run']}: rollout:scores/bf16, rollout:scores/loud)"
    ) in one_line(result)


def test_limits_null_in_every_comparison_exit_2(runs):
    dense = runs["dense"]
    result = gate(dense, "--max", "router_diff_rate=0.1", "--max", "token_diff_rate=0.1")
    assert result.exit_code == 2
    assert (
        f"error: gate compares nothing: every check is skipped (router_diff_rate, token_diff_rate null in every "
        f"comparison of {dense}: rollout:scores/bf16)"
    ) in one_line(result)
    # One metric that applies is enough: the routing limit is skipped, the gate passes.
    result = gate(dense, "--max", "router_diff_rate=0.1", "--max", "k3_kl=10")
    assert result.exit_code == 0 and "0 of 2 checks failed (1 skipped)" in one_line(result)


# ---- metrics.json of another schema version -----------------------------------------------------------


@pytest.mark.parametrize("version", [2, 0, None, "1"])
def test_a_baseline_of_another_schema_version_exit_2(runs, tmp_path, version):
    old = _copy(runs, tmp_path, "old")
    path = old / "report" / "metrics.json"
    _edit(path, schema_version=version)
    result = gate(runs["run"], "--baseline", old)
    assert result.exit_code == 2
    assert f"error: {path}: schema_version {version!r}, expected 1 (re-run `probe report {old}`" in one_line(result)
    # The run's own metrics.json, and probe compare, refuse it alike.
    assert f"{path}: schema_version {version!r}, expected 1" in one_line(gate(old, "--max", "k3_kl=1"))
    result = runner.invoke(app, ["compare", str(runs["run"]), str(old), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 2 and f"{path}: schema_version {version!r}, expected 1" in one_line(result)


# ---- a baseline of another kind ------------------------------------------------------------------------


def test_a_baseline_of_the_same_kind_gives_no_warning(runs):
    result = gate(runs["wider"], "--baseline", runs["run"], "--strict")
    assert result.exit_code == 0 and "warning" not in result.output


def test_a_dense_baseline_for_a_moe_run_warns_and_strict_refuses(runs):
    run, dense = runs["run"], runs["dense"]
    result = gate(run, "--baseline", dense, "--max", "k3_kl=10")
    assert result.exit_code == 0, result.output  # the warning changes no verdict
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: baseline {dense}: the run is MoE but the baseline is dense"]
    result = gate(run, "--baseline", dense, "--max", "k3_kl=10", "--strict")
    assert result.exit_code == 2
    assert (
        f"error: {dense}/manifest.json: the baseline is another kind of run than {run} (the run is MoE but "
        "the baseline is dense); --strict refuses it"
    ) in one_line(result)


def test_a_baseline_of_another_model_warns_per_difference(runs, tmp_path):
    other = _copy(runs, tmp_path, "other-model")
    _edit(other / "manifest.json", config_hash="0123abcd", model="/models/other", top_k=2)
    result = gate(runs["run"], "--baseline", other)
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        f"warning: baseline {other}: config_hash differs: run 'synthetic', baseline '0123abcd'",
        f"warning: baseline {other}: model differs: run 'synthetic', baseline '/models/other'",
        f"warning: baseline {other}: top_k differs: run 4, baseline 2",
    ]
    result = gate(runs["run"], "--baseline", other, "--strict")
    assert (
        result.exit_code == 2
        and "config_hash differs: run 'synthetic', baseline '0123abcd'; model differs" in one_line(result)
    )


# ---- limits and keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, shown", [("-1", "-1.0"), ("-1e-9", "-1e-09"), ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf")]
)
def test_unusable_limits_exit_2(runs, value, shown):
    result = gate(runs["run"], "--max", f"k3_kl={value}")
    assert result.exit_code == 2
    assert f"error: --max k3_kl: limit {shown} is not usable; expected a finite number >= 0" in one_line(result)


@pytest.mark.parametrize("value, shown", [("-1e-3", "-0.001"), ("inf", "inf"), ("nan", "nan")])
def test_unusable_toml_limits_exit_2(runs, tmp_path, value, shown):
    limits = tmp_path / "limits.toml"
    limits.write_text(f'[max]\nk3_kl = 1\n"extreme_fraction@2" = {value}\n')
    result = gate(runs["run"], "--config", limits)
    assert result.exit_code == 2
    assert f"error: {limits}: [max] extreme_fraction@2: limit {shown} is not usable" in one_line(result)


def test_zero_is_a_usable_limit(runs):
    assert gate(runs["run"], "--max", "abs_logprob_diff_mean=0").exit_code == 1


@pytest.mark.parametrize(
    "key, close",
    [("k3_k", "k3_kl"), ("extreme_fractoin@2", "extreme_fraction@2"), ("router_dif_rate", "router_diff_rate")],
)
def test_an_unknown_key_gets_did_you_mean(runs, key, close):
    result = gate(runs["run"], "--max", f"{key}=1")
    assert result.exit_code == 2
    assert f"error: --max {key}: unknown metric; did you mean {close}? (valid keys: n_tokens, k3_kl" in one_line(result)


# ---- the count of failed checks ------------------------------------------------------------------------


def test_the_summary_counts_failed_checks(runs):
    comps = json.loads((runs["run"] / "report" / "metrics.json").read_text())["comparisons"]
    k3 = {c["candidate"]: c["metrics"]["k3_kl"] for c in comps}
    limit = (k3["scores/bf16"] + k3["scores/loud"]) / 2  # between the two: loud fails, bf16 passes
    args = ["--max", f"k3_kl={limit}", "--max", "abs_logprob_diff_max=100"]
    result = gate(runs["run"], *args)
    assert result.exit_code == 1
    assert result.stdout.rstrip().splitlines()[-1] == "1 of 4 checks failed"
    out = json.loads(gate(runs["run"], *args, "--json").stdout)
    assert (out["passed"], out["failed"], out["skipped"], out["total"]) == (False, 1, 0, 4)
