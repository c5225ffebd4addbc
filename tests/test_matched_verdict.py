"""The verdict speaks of the matched score set: a set's recorded role first, then the plain set at the rollout's
dtype, then the largest k3; the verdict line names the rule. Runs written before roles still read."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report
from mismatch_probe.report.verdict.bands import PUBLISHED
from mismatch_probe.report.verdict.matched import BY_DTYPE, BY_K3, BY_ROLE, choose
from mismatch_probe.report.verdict.summary import rows, verdict
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.roles import options_role, recorded_role
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()
# The matched bf16 set has the smallest k3: a fp32 pass and a sweep variant have larger ones.
SETS = (
    ScoreSetSpec("hf-bf16", logprob_sigma=0.02, role="matched"),
    ScoreSetSpec("hf-fp32", logprob_sigma=0.2, dtype="float32", role="fp32"),
    ScoreSetSpec("hf-bf16+router_dtype-fp32", logprob_sigma=0.3, role="sweep"),
)


def spec(*sets: ScoreSetSpec) -> SyntheticSpec:
    return SyntheticSpec(n_samples=8, prompt_len=(2, 4), response_len=(6, 10), score_sets=sets)


def chosen(root) -> tuple:
    run = Run(root)
    metrics = build_report(root).metrics
    table = rows(metrics, run.side_infos(), PUBLISHED, is_moe=True)
    choice = choose(table)
    return choice, verdict(metrics, table), max(r.metrics["k3_kl"] for r in table)


def test_verdict_names_the_matched_set_while_a_variant_has_a_larger_k3(tmp_path):
    choice, line, largest = chosen(write_synthetic_run(tmp_path / "run", spec(*SETS)))
    assert choice.row.names == [("rollout", "scores/hf-bf16")] and choice.rule == BY_ROLE
    assert choice.row.metrics["k3_kl"] < largest / 10  # a diagnostic set's k3 is far larger, and not the verdict's
    assert line.endswith("(rollout vs scores/hf-bf16: the matched set).")


def test_without_roles_the_plain_set_at_the_rollouts_dtype_then_the_largest_k3(tmp_path):
    # a run written before roles: the fp32 set is plain too, but not at the rollout's dtype (bfloat16)
    old = tuple(ScoreSetSpec(s.name, logprob_sigma=s.logprob_sigma, dtype=s.dtype) for s in SETS)
    choice, line, _ = chosen(write_synthetic_run(tmp_path / "old", spec(*old)))
    assert choice.row.names == [("rollout", "scores/hf-bf16")] and choice.rule == BY_DTYPE
    assert line.endswith(f"(rollout vs scores/hf-bf16: {BY_DTYPE}).")
    # no set at the rollout's dtype: the plain comparison of largest k3, and the line says so
    fp32 = (ScoreSetSpec("a", logprob_sigma=0.02, dtype="float32"), ScoreSetSpec("b", logprob_sigma=0.3, dtype="fp32"))
    choice, line, largest = chosen(write_synthetic_run(tmp_path / "fp32", spec(*fp32)))
    assert choice.row.names == [("rollout", "scores/b")] and choice.rule == BY_K3
    assert choice.row.metrics["k3_kl"] == largest and line.endswith(f"(rollout vs scores/b: {BY_K3}).")


def test_role_read_from_older_manifests_and_implied_by_options(tmp_path):
    root = write_synthetic_run(
        tmp_path / "run",
        spec(ScoreSetSpec("x", replay="r3"), ScoreSetSpec("p1", repeat_group="p", pass_index=1), ScoreSetSpec("y+k-v")),
    )
    run = Run(root)
    for name in ("x", "p1", "y+k-v"):
        manifest = json.loads((run.score_dir(name) / "manifest.json").read_text())
        assert manifest["role"] is None  # the key is written, unrecorded here
        del manifest["role"]  # as a run written before roles
        (run.score_dir(name) / "manifest.json").write_text(json.dumps(manifest))
    assert {name: recorded_role(run.score_manifest(name), name) for name in ("x", "p1", "y+k-v")} == {
        "x": "r3",
        "p1": "repeats",
        "y+k-v": "sweep",
    }
    plain = dict(replay="none", repeats=1, sampling="raw", old=None)
    assert options_role(engine_args={}, **plain) is None
    assert options_role(engine_args={"act_quant": "fp8-token128"}, **plain) == "quant"
    assert options_role(engine_args={}, **(plain | {"sampling": "rollout"})) == "sampling"


@pytest.mark.parametrize("role", ["matchd", "train"])
def test_rescore_role_is_checked_before_any_work(tmp_path, role):
    root = write_synthetic_run(tmp_path / "run", spec(ScoreSetSpec("a")))
    result = runner.invoke(app, ["rescore", str(root), "--role", role])
    assert result.exit_code == 2
    assert f"--role {role!r}: expected matched or a diagnostic role" in result.output
    assert sorted(p.name for p in (root / "scores").iterdir()) == ["a"]


def test_a_recorded_runs_training_logprobs_are_the_matched_set(tmp_path):
    import numpy as np

    from mismatch_probe.record import Recorder

    rng = np.random.default_rng(0)
    with Recorder(tmp_path / "rec") as rec:
        for _ in range(4):
            lp = rng.uniform(-3.0, -0.1, 12)
            rec.add([1, 2], rng.integers(0, 50, 12), lp, np.minimum(lp + rng.normal(0, 0.05, 12), 0.0))
    run = Run(tmp_path / "rec")
    (name,) = run.score_sets()
    assert run.score_manifest(name).role == "matched"
    choice, line, _ = chosen(run.root)
    assert choice.rule == BY_ROLE and line.endswith(f"(rollout vs scores/{name}: the matched set).")
