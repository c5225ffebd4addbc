"""Policy staleness (R2 vs R3) and RSPO's router shift, on a real tiny policy run (tests/policy_runs.py):
known answers, and every policy key against an independent per-sequence loop over the same Parquet."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DEMO_DENSE, DEMO_MOE, DEMO_PROMPTS
from policy_runs import make_policy_run, router_perturbed, score_policy_passes
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report

runner = CliRunner()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    new = router_perturbed(DEMO_MOE, root / "new", scale=0.1)
    run = make_policy_run(root, DEMO_MOE, DEMO_PROMPTS, new, num_prompts=16)
    metrics = build_report(run, render=False).metrics
    by_candidate = {c["candidate"]: c for c in metrics["comparisons"] if c.get("kind") == "policy"}
    return run, new, by_candidate


def side(run, name) -> dict:
    """Every column of a side, rows in (sample_id, position) order, as numpy (list columns as [n, width])."""
    folder = run / "rollout" if name == "rollout" else run / "scores" / name
    table = pq.read_table(sorted(folder.glob("part-*.parquet")))
    out = {}
    for column in table.column_names:
        values = table.column(column).to_pylist()
        if isinstance(values[0], list) or values[0] is None:
            out[column] = [None if v is None else np.array(v) for v in values]
        else:
            out[column] = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    return out


def naive_policy(run, old: str, new: str, natural: str | None, num_layers: int, top_k: int) -> dict:
    """One Python loop over rows: the decomposition, the replay bias and override, and γ on router row p - 1."""
    mu, lo, ln = side(run, "rollout"), side(run, old), side(run, new)
    nat = side(run, natural) if natural else None
    a, s, b, gammas, deltas, routes, overridden = [], [], [], [], [], 0, 0
    for i in range(len(mu["sample_id"])):
        values = [mu["logprob"][i], lo["logprob"][i], ln["logprob"][i]] + ([nat["logprob"][i]] if nat else [])
        if not mu["is_response"][i] or not all(math.isfinite(v) for v in values):
            continue
        a.append(lo["logprob"][i] - mu["logprob"][i])
        s.append(ln["logprob"][i] - lo["logprob"][i])
        if nat:
            b.append(ln["logprob"][i] - nat["logprob"][i])
        j = i - 1  # the forward that scored token i
        if j < 0 or mu["sample_id"][j] != mu["sample_id"][i]:
            continue
        own = lo["expert_logprobs"][j] if "expert_logprobs" in lo else None  # none from megatron
        at_old = ln["expert_logprobs_at_old"][j] if "expert_logprobs_at_old" in ln else None
        if own is not None and at_old is not None:
            d = np.abs(at_old.astype(np.float64) - own).reshape(num_layers, top_k).mean(axis=1).mean()
            deltas.append(d)
            gammas.append(math.exp(-d))
        if nat:
            x, y = ln["experts"][j].reshape(num_layers, top_k), nat["experts"][j].reshape(num_layers, top_k)
            routes += num_layers
            overridden += sum(set(x[layer]) != set(y[layer]) for layer in range(num_layers))
    a, s, b = np.array(a), np.array(s), np.array(b)
    t = a + s
    k3 = lambda x: float(np.mean(np.exp(x) - 1 - x))  # noqa: E731
    out = {
        "n_policy_tokens": len(a),
        "k3_kl": k3(s),
        "tid_k3_kl": k3(a),
        "total_k3_kl": k3(t),
        "tid_log_ratio_var": float(np.var(a)),
        "stale_log_ratio_var": float(np.var(s)),
        "tid_stale_log_ratio_cov": float(np.mean(a * s) - a.mean() * s.mean()),
        "total_log_ratio_var": float(np.var(t)),
        "ppo_ratio_below_fraction@0.8": float(np.mean(np.exp(s) < 0.8)),
        "ppo_ratio_above_fraction@1.2": float(np.mean(np.exp(s) > 1.2)),
        "ppo_ratio_above_fraction@1.27": float(np.mean(np.exp(s) > 1.27)),
        "total_tis_clip_fraction@2": float(np.mean(np.exp(t) > 2)),
        "total_tis_clip_fraction@5": float(np.mean(np.exp(t) > 5)),
    }
    if nat:
        out |= {
            "replay_bias_k3_kl": k3(b),
            "replay_bias_mean": float(b.mean()),
            "replay_override_rate": overridden / routes,
        }
    if gammas:
        g = np.array(gammas)
        out |= {
            "router_shift_delta_mean": float(np.mean(deltas)),
            "router_shift_ratio_mean": float(g.mean()),
            "router_shift_clip_fraction@0.8": float(np.mean(g < 0.8)),
        }
    return out


def naive_for(run, comp: dict) -> dict:
    """`naive_policy` for one policy comparison of metrics.json."""
    manifest = json.loads((run / "manifest.json").read_text())
    name = lambda side: side and side.removeprefix("scores/")  # noqa: E731
    return naive_policy(
        run,
        name(comp["reference"]),
        name(comp["candidate"]),
        name(comp["natural"]),
        manifest["num_layers"],
        manifest["top_k"],
    )


@pytest.mark.slow
def test_every_policy_key_matches_an_independent_loop(policy):
    run, _, comps = policy
    assert set(comps) == {
        f"scores/{n}" for n in ("hf-fp32-step1", "hf-fp32-r2-step1", "hf-fp32-r3-step1", "hf-fp32-r2-step0")
    }
    for candidate, comp in comps.items():
        want = naive_for(run, comp)
        got = comp["metrics"]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (candidate, key)
            if key != "n_policy_tokens":
                low, high = got[f"{key}_ci95"]
                assert low <= high


@pytest.mark.slow
def test_every_policy_key_is_declared_and_written(policy):
    from mismatch_probe.frames.bootstrap import CI_SUFFIX
    from mismatch_probe.report.keys.catalogue import CATALOGUE, declared
    from mismatch_probe.report.keys.metric_key import BOOTSTRAP

    _, _, comps = policy
    written = {key for comp in comps.values() for key in comp["metrics"]}
    for key in written:
        assert declared(key.removesuffix(CI_SUFFIX)) is not None, key
    for entry in (e for e in CATALOGUE if e.group == "policy"):
        keys = [key for key in written if entry.matches(key)]
        assert keys, entry.name
        assert all((key + CI_SUFFIX in written) == (entry.interval == BOOTSTRAP) for key in keys), entry.name


@pytest.mark.slow
def test_known_answers(policy):
    run, new, comps = policy
    r2_step0 = comps["scores/hf-fp32-r2-step0"]
    assert r2_step0["replay"] == "r2" and r2_step0["policy_step"] == 0 and r2_step0["natural"] == "scores/hf-fp32"
    for column in ("logprob", "experts", "expert_logprobs"):  # R2 at the rollout's own checkpoint is the old pass
        old = pq.read_table(sorted((run / "scores/hf-fp32").glob("*.parquet"))).column(column)
        same = pq.read_table(sorted((run / "scores/hf-fp32-r2-step0").glob("*.parquet"))).column(column)
        assert old.equals(same), column
    m = r2_step0["metrics"]
    assert m["k3_kl"] == 0 and m["replay_bias_k3_kl"] == 0 and m["replay_bias_mean"] == 0
    assert m["router_shift_ratio_mean"] == 1 and m["router_shift_delta_mean"] == 0
    assert m["router_shift_clip_fraction@0.8"] == 0 and m["replay_override_rate"] == 0
    for comp in comps.values():  # Var(t) = Var(a) + Var(s) + 2 Cov(a, s)
        x = comp["metrics"]
        split = x["tid_log_ratio_var"] + x["stale_log_ratio_var"] + 2 * x["tid_stale_log_ratio_cov"]
        assert abs(x["total_log_ratio_var"] - split) <= 1e-12
    natural, r2 = comps["scores/hf-fp32-step1"]["metrics"], comps["scores/hf-fp32-r2-step1"]["metrics"]
    assert natural["replay_bias_k3_kl"] == 0 and natural["replay_override_rate"] == 0  # N against itself
    # only the routers moved: replaying θ_old's routes removes most of the staleness
    assert r2["k3_kl"] < natural["k3_kl"] / 4 and r2["k3_kl_ci95"][1] < natural["k3_kl_ci95"][0]
    assert 0 < r2["replay_override_rate"] and natural["router_shift_ratio_mean"] < 1


@pytest.mark.slow
def test_new_checkpoint_manifest(policy):
    run, new, _ = policy
    rollout = json.loads((run / "manifest.json").read_text())
    old = json.loads((run / "scores/hf-fp32/manifest.json").read_text())
    step1 = json.loads((run / "scores/hf-fp32-r2-step1/manifest.json").read_text())
    step0 = json.loads((run / "scores/hf-fp32-r2-step0/manifest.json").read_text())
    assert old["policy"] is None and step1["policy"] == {
        "role": "new",
        "step": 1,
        "old": "hf-fp32",
        "replay_source": "scores/hf-fp32",
    }
    assert step1["config_hash"] != rollout["config_hash"]  # re-saved config.json: accepted on shape and architecture
    assert step1["weights_sha256"] != old["weights_sha256"] == step0["weights_sha256"] == rollout["weights_sha256"]
    # the engines' fingerprint covers the embeddings, head and norm only: equal, which is why the files are hashed
    assert step1["engine"]["weights_fingerprint"] == old["engine"]["weights_fingerprint"]
    comparisons = json.loads((run / "report/metrics.json").read_text())["comparisons"]
    pairs = {(c["reference"], c["candidate"]) for c in comparisons}
    assert ("scores/hf-fp32", "scores/hf-fp32-step1") in pairs
    assert ("rollout", "scores/hf-fp32-step1") not in pairs  # a new policy is no engine mismatch


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--replay", "r2"], "--replay r2 replays the routes of an --old score set: name it with --old NAME"),
        (
            ["--policy-step", "1"],
            "--policy-step N labels a new policy's pass: name the θ_old score set with --old NAME",
        ),
        (["--old", "nope"], "--old nope: "),
        (["--old", "hf-fp32", "--dtype", "bf16"], "hf-fp32/manifest.json: dtype is 'fp32', expected bf16"),
        (
            ["--old", "hf-fp32", "--replay", "r3"],
            "hf-fp32/manifest.json: replay is 'none', expected r3 (for --replay r3)",
        ),
        (["--old", "hf-fp32-r3"], "hf-fp32-r3/manifest.json: replay is 'r3', expected none (for --replay none)"),
        (["--old", "hf-fp32-r2-step1"], "hf-fp32-r2-step1/manifest.json: policy is"),
    ],
)
def test_bad_policy_options_exit_2(policy, args, message):
    run, new, _ = policy
    result = runner.invoke(app, ["rescore", str(run), "--model", str(new), "--name", "x", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not (run / "scores" / "x").exists()


@pytest.mark.slow
def test_router_logprobs_need_an_moe_rollout(tmp_path):
    from mismatch_probe.engines.base import EngineConfig, SamplingParams
    from mismatch_probe.pipeline.generate import GenerateJob, run_generate

    run = tmp_path / "dense"
    run_generate(
        GenerateJob(
            model=DEMO_DENSE,
            prompts=DEMO_PROMPTS,
            out=run,
            engine="hf",
            params=SamplingParams(max_new_tokens=4),
            config=EngineConfig(dtype="fp32"),
            num_prompts=2,
        )
    )
    result = runner.invoke(app, ["rescore", str(run), "--router-logprobs"])
    assert result.exit_code == 2 and "--router-logprobs needs an MoE rollout, but this model is dense" in result.output


def test_router_logprobs_refuse_sigmoid_routers_and_other_engines(tmp_path):
    from moe_families import FAMILIES, save_family

    from mismatch_probe.errors import ProbeError
    from mismatch_probe.model.routing_shape import load_model_info
    from mismatch_probe.pipeline.policy_pass import check_router_logprobs

    family = next(f for f in FAMILIES if f.name == "deepseek_v3")
    sigmoid = load_model_info(save_family(family, tmp_path / "dsv3"))
    with pytest.raises(
        ProbeError, match="the hf engine cannot read router log-probabilities of the DeepSeek-V3 / Kimi-K2 family"
    ):
        check_router_logprobs("hf", sigmoid)
    softmax = load_model_info(DEMO_MOE)
    check_router_logprobs("hf", softmax)
    wanted = f"the megatron engine cannot read router log-probabilities of the {softmax.moe_family} family"
    with pytest.raises(ProbeError, match=re.escape(wanted)):
        check_router_logprobs("megatron", softmax)


@pytest.mark.slow
def test_gate_holds_policy_comparisons_to_policy_limits_unless_named(policy):
    from mismatch_probe.gate.check import evaluate

    run, _, comps = policy
    checks = evaluate(run, {"k3_kl": 1.0, "router_shift_clip_fraction@0.8": 1.0})
    policy_checks = [c for c in checks if c.candidate in comps]
    assert policy_checks and {c.metric for c in policy_checks} == {"router_shift_clip_fraction@0.8"}
    assert {c.candidate for c in policy_checks} == set(comps)  # an R3 θ_old's too: not a diagnostic comparison
    assert {c.metric for c in checks if c.candidate not in comps} == {"k3_kl", "router_shift_clip_fraction@0.8"}
    named = evaluate(run, {"k3_kl": 1.0}, pairs=["scores/hf-fp32:scores/hf-fp32-step1"])
    assert [(c.candidate, c.metric, c.status) for c in named] == [("scores/hf-fp32-step1", "k3_kl", "pass")]


@pytest.mark.slow
def test_megatron_policy_passes(policy, tmp_path):
    """The same passes through the megatron engine on a copy of the rollout: R2 at the rollout's own checkpoint
    reproduces the old set bit for bit, R2 routes with the old set's experts, R3 with the rollout's, and the
    report pairs each new set with its θ_old and checks its keys against the same naive loop."""
    source, new, _ = policy
    run = tmp_path / "run"
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("scores", "report"))
    score_policy_passes(run, "megatron", DEMO_MOE, new, router_logprobs=False)

    def table(name):
        return pq.read_table(sorted((run / "scores" / name).glob("part-*.parquet")))

    for column in ("logprob", "experts"):
        assert table("megatron-fp32").column(column).equals(table("megatron-fp32-r2-step0").column(column))
    old = side(run, "megatron-fp32")
    natural, r2 = side(run, "megatron-fp32-step1"), side(run, "megatron-fp32-r2-step1")
    r3_old, r3 = side(run, "megatron-fp32-r3"), side(run, "megatron-fp32-r3-step1")
    routed = [i for i, e in enumerate(old["experts"]) if e is not None]
    assert all(np.array_equal(old["experts"][i], r2["experts"][i]) for i in routed)
    replayed = [i for i, e in enumerate(side(run, "rollout")["experts"]) if e is not None]  # no last token
    assert replayed and all(np.array_equal(r3_old["experts"][i], r3["experts"][i]) for i in replayed)
    assert any(not np.array_equal(old["experts"][i], natural["experts"][i]) for i in routed)  # the routers moved

    comps = {
        c["candidate"]: c for c in build_report(run, render=False).metrics["comparisons"] if c.get("kind") == "policy"
    }
    assert set(comps) == {
        f"scores/{n}"
        for n in ("megatron-fp32-step1", "megatron-fp32-r2-step1", "megatron-fp32-r3-step1", "megatron-fp32-r2-step0")
    }
    for candidate, comp in comps.items():
        want = naive_for(run, comp)
        assert not any(key.startswith("router_shift") for key in want)  # no router log-probs from megatron
        assert comp["metrics"].get("router_shift_ratio_mean") is None, candidate
        for key, value in want.items():
            assert comp["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (candidate, key)
    stale = {c["replay"]: c["metrics"]["k3_kl"] for c in comps.values() if c["policy_step"] == 1}
    assert stale["r2"] < stale["none"] / 4
