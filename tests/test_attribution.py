"""metrics.json's `attribution` against hand computation on synthetic runs with planted sides.

The synthetic candidates are the rollout's log-probs plus Gaussian noise of a chosen size, so each
statement has a known direction: the R3 side is less noisy than its twin without replay, the fp32 side
least of all. Numbers are checked against a second, naive computation over the Parquet rows.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from naive_metrics import read_side, sequence_deltas
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.frames.bootstrap import RESAMPLES, SEED, poisson_weights
from mismatch_probe.report.build import build_report
from mismatch_probe.report.numbers import value, with_interval
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

SIDES = (
    ScoreSetSpec("hf-bf16", logprob_sigma=0.05, engine="hf", dtype="bf16", nonfinite_fraction=0.02),
    ScoreSetSpec("hf-bf16-r3", logprob_sigma=0.02, engine="hf", dtype="bf16", replay="r3", route_fraction=0.0),
    ScoreSetSpec("hf-fp32", logprob_sigma=0.01, engine="hf", dtype="fp32"),
    ScoreSetSpec("hf-bf16-pass1", logprob_sigma=0.03, engine="hf", dtype="bf16", repeat_group="hf-bf16", pass_index=1),
    ScoreSetSpec("hf-bf16-pass2", logprob_sigma=0.03, engine="hf", dtype="bf16", repeat_group="hf-bf16", pass_index=2),
    ScoreSetSpec("megatron-bf16", logprob_sigma=0.05, engine="megatron", dtype="bfloat16"),
    ScoreSetSpec("megatron-fp32", logprob_sigma=0.01, engine="megatron", dtype="float32"),
)
# Three part files per side: the streaming accumulators merge across chunks.
SPEC = SyntheticSpec(n_samples=36, prompt_len=(2, 5), response_len=(4, 16), samples_per_part=12, score_sets=SIDES)
ENGINE_PAIRS = [("scores/hf-fp32", "scores/megatron-fp32"), ("scores/hf-bf16", "scores/megatron-bf16")]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("attr") / "run", SPEC)
    metrics = build_report(
        root, pairs=[f"+{a}:{b}" for a, b in ENGINE_PAIRS], render=False
    ).metrics  # the defaults and these
    rows = {side: read_side(root / side) for side in ["rollout"] + [f"scores/{s.name}" for s in SIDES]}
    return root, metrics, rows


def _deltas(rows, ref, cand) -> dict[int, list[float]]:
    return sequence_deltas(rows[ref], rows[cand])


def _k3(sequences: dict[int, list[float]], weights: dict[int, float] | None = None) -> float:
    num = den = 0.0
    for sid, deltas in sequences.items():
        w = 1.0 if weights is None else weights[sid]
        num += w * sum(math.exp(d) - 1 - d for d in deltas)
        den += w * len(deltas)
    return num / den


def _naive_paired_interval(num_seqs, den_seqs, transform) -> list[float]:
    """Resample by resample: the same Poisson weight per sequence in both comparisons, then percentiles."""
    ids = sorted(set(num_seqs) | set(den_seqs))
    weights = poisson_weights(np.array(ids), SEED, RESAMPLES)
    values = []
    for b in range(RESAMPLES):
        w = {sid: weights[i, b] for i, sid in enumerate(ids)}
        values.append(transform(_k3(num_seqs, w) / _k3(den_seqs, w)))
    point = transform(_k3(num_seqs) / _k3(den_seqs))
    low, high = np.quantile(values, [0.025, 0.975])
    return [min(low, point), max(high, point)]


def test_noise_floor_is_pass_against_pass(planted):
    root, metrics, rows = planted
    attribution = metrics["attribution"]
    (floor,) = attribution["noise_floor"]
    assert floor | {"k3_kl": None, "k3_kl_ci95": None, "n_tokens": None} == {
        "reference": "scores/hf-bf16-pass1",
        "candidate": "scores/hf-bf16-pass2",
        "engine": "hf",
        "role": "training",
        "dtype": "bf16",
        "replay": "none",
        "repeat_group": "hf-bf16",
        "k3_kl": None,
        "k3_kl_ci95": None,
        "n_tokens": None,
    }
    seqs = _deltas(rows, "scores/hf-bf16-pass1", "scores/hf-bf16-pass2")
    assert floor["k3_kl"] == pytest.approx(_k3(seqs), rel=1e-9)
    assert floor["n_tokens"] == sum(len(s) for s in seqs.values())
    comp = next(
        c for c in metrics["comparisons"] if c["candidate"] == "scores/hf-bf16-pass2" and c["reference"] != "rollout"
    )
    assert floor["k3_kl_ci95"] == comp["metrics"]["k3_kl_ci95"]


def test_routing_share_with_paired_bootstrap(planted):
    root, metrics, rows = planted
    shares = metrics["attribution"]["routing_share"]
    assert [(s["reference"], s["without_replay"], s["with_replay"]) for s in shares] == [
        ("rollout", "scores/hf-bf16", "scores/hf-bf16-r3")
    ]
    share = shares[0]
    without, with_r3 = _deltas(rows, "rollout", "scores/hf-bf16"), _deltas(rows, "rollout", "scores/hf-bf16-r3")
    assert share["k3_kl_without_replay"] == pytest.approx(_k3(without), rel=1e-9)
    assert share["k3_kl_with_replay"] == pytest.approx(_k3(with_r3), rel=1e-9)
    assert share["share"] == pytest.approx(1 - _k3(with_r3) / _k3(without), rel=1e-9)
    expected = _naive_paired_interval(with_r3, without, lambda ratio: 1 - ratio)
    assert share["share_ci95"] == pytest.approx(expected, rel=1e-9)
    # Planted: noise 0.02 against 0.05, so k3 falls to about (0.02 / 0.05)^2 of itself.
    assert 0.6 < share["share_ci95"][0] <= share["share"] <= share["share_ci95"][1] < 1.0
    # Pairing matters: an unpaired interval from the two marginal intervals would be far wider.
    lo_w, hi_w = share["k3_kl_with_replay_ci95"]
    lo_n, hi_n = share["k3_kl_without_replay_ci95"]
    assert (share["share_ci95"][1] - share["share_ci95"][0]) < (hi_w / lo_n - lo_w / hi_n)


def test_error_split_matches_numpy(planted):
    root, metrics, rows = planted
    entries = {(e["reference"], e["candidate"]): e for e in metrics["attribution"]["numerics"]}
    # Sides in fp32 are not split (their error against fp32 is the engine gap); repeated passes are not either.
    assert set(entries) == {
        ("rollout", "scores/hf-bf16"),
        ("rollout", "scores/megatron-bf16"),
        ("scores/hf-bf16", "scores/megatron-bf16"),
    }
    assert entries["rollout", "scores/hf-bf16"]["fp32"] == "scores/hf-fp32"  # the candidate's engine first
    assert entries["scores/hf-bf16", "scores/megatron-bf16"]["fp32"] == "scores/megatron-fp32"
    for (ref, cand), entry in entries.items():
        f = rows[entry["fp32"]]
        picked = [
            (a["logprob"], b["logprob"], c["logprob"])
            for a, b, c in zip(rows[ref], rows[cand], f)
            if a["is_response"]
            and all(v is not None and math.isfinite(v) for v in (a["logprob"], b["logprob"], c["logprob"]))
        ]
        lp = np.array(picked, dtype=np.float64)
        e_ref, e_cand = lp[:, 0] - lp[:, 2], lp[:, 1] - lp[:, 2]
        cov = np.cov(e_ref, e_cand, bias=True)
        assert entry["n_tokens"] == len(lp)
        assert entry["var_ref"] == pytest.approx(cov[0, 0], rel=1e-9)
        assert entry["var_cand"] == pytest.approx(cov[1, 1], rel=1e-9)
        assert entry["cov"] == pytest.approx(cov[0, 1], rel=1e-7, abs=1e-15)
        assert entry["var_delta"] == pytest.approx(np.var(e_cand - e_ref), rel=1e-9)
        assert entry["share_ref"] + entry["share_cand"] + entry["share_cov"] == pytest.approx(1.0, rel=1e-9)
        assert entry["mean_error_ref"] == pytest.approx(e_ref.mean(), rel=1e-9, abs=1e-15)
        assert entry["correlation"] == pytest.approx(np.corrcoef(e_ref, e_cand)[0, 1], rel=1e-7, abs=1e-12)
    # Planted: the rollout's error against hf-fp32 is its own noise-free log-prob minus fp32's noise (0.01),
    # hf-bf16's adds its 0.05, so the candidate carries most of var(delta).
    hf = entries["rollout", "scores/hf-bf16"]
    assert hf["share_cand"] > 0.8 > hf["share_ref"]


def test_engine_gap_and_ratio_to_noise_floor(planted):
    root, metrics, rows = planted
    gaps = {(g["reference"], g["candidate"]): g for g in metrics["attribution"]["engine_gap"]}
    assert set(gaps) == {("rollout", "scores/hf-bf16"), ("rollout", "scores/megatron-bf16"), *ENGINE_PAIRS}
    fp32 = gaps["scores/hf-fp32", "scores/megatron-fp32"]
    assert (fp32["engine_ref"], fp32["engine_cand"], fp32["dtype"]) == ("hf", "megatron", "fp32")
    assert fp32["noise_floor"] is None and fp32["ratio_to_noise_floor"] is None  # no fp32 repeated passes
    bf16 = gaps["rollout", "scores/hf-bf16"]
    assert (bf16["role_ref"], bf16["engine_cand"], bf16["role_cand"]) == ("inference", "hf", "training")
    gap = _deltas(rows, "rollout", "scores/hf-bf16")
    floor = _deltas(rows, "scores/hf-bf16-pass1", "scores/hf-bf16-pass2")
    assert bf16["k3_kl"] == pytest.approx(_k3(gap), rel=1e-9)
    assert bf16["noise_floor"]["reference"] == "scores/hf-bf16-pass1"
    assert bf16["ratio_to_noise_floor"] == pytest.approx(_k3(gap) / _k3(floor), rel=1e-9)
    assert bf16["ratio_to_noise_floor_ci95"] == pytest.approx(_naive_paired_interval(gap, floor, lambda r: r), rel=1e-9)


def test_headlines_state_each_entry_with_its_numbers(planted):
    root, metrics, _ = planted
    attribution = metrics["attribution"]
    lines = attribution["headlines"]
    floor, share = attribution["noise_floor"][0], attribution["routing_share"][0]
    assert len(lines) == sum(len(attribution[k]) for k in ("noise_floor", "routing_share", "numerics", "engine_gap"))
    # the effects first, the noise floor they are measured against last
    assert with_interval(floor["k3_kl"], floor["k3_kl_ci95"]) in lines[-1]
    assert lines[-1].startswith("Noise floor")
    low, high = share["share_ci95"]
    assert f"{value(100 * share['share'])}% [{value(100 * low)}%, {value(100 * high)}%]" in lines[0]
    for e in attribution["numerics"]:
        assert any(
            f"{e['candidate']} {value(e['var_cand'])}" in line and f"correlate at {value(e['correlation'])}" in line
            for line in lines
        )
    gap = next(g for g in attribution["engine_gap"] if g["noise_floor"])
    assert any(f"{value(gap['ratio_to_noise_floor'])}×" in line and "noise floor" in line for line in lines)
    # Everything needed is here: only the megatron noise floor is missing.
    assert attribution["missing"] == [
        f"add `probe rescore {root} --engine megatron --dtype bf16 --repeats 2` for the noise floor of megatron "
        "training at bf16 (pass against pass)",
        f"add `probe rescore {root} --engine megatron --dtype bf16 --replay r3` for the routing-induced share of "
        "megatron training at bf16 (k3 with against without R3)",
    ]


def test_summary_prints_verdict_and_table_then_findings(planted):
    root, metrics, _ = planted
    result = CliRunner().invoke(
        app, ["report", str(root), "--pair", "rollout:scores/hf-bf16", "--pair", "rollout:scores/hf-bf16-r3"]
    )
    assert result.exit_code == 0, result.output
    written = json.loads((root / "report" / "metrics.json").read_text())["attribution"]
    out = result.output.splitlines()
    table_at = next(i for i, line in enumerate(out) if "mismatch:" in line)
    assert out[0].startswith("Training and inference") and table_at == 1  # the verdict, then the summary table
    assert [line for line in out[table_at:] if line.startswith("finding: ")] == [
        f"finding: {h}" for h in written["headlines"]
    ]
    assert [line for line in out[table_at:] if line.startswith("missing: ")] == [
        f"missing: {m}" for m in written["missing"]
    ]
    assert written["routing_share"] and not written["noise_floor"]


def _sparse_run(tmp_path, num_layers: int, *sides: ScoreSetSpec):
    spec = SyntheticSpec(num_layers=num_layers, n_samples=6, prompt_len=(2, 3), response_len=(3, 5), score_sets=sides)
    root = write_synthetic_run(tmp_path / f"run{num_layers}", spec)
    return root, build_report(root, render=False).metrics["attribution"]


def test_missing_says_which_rescore_adds_each_statement(tmp_path):
    root, attribution = _sparse_run(tmp_path, 4, ScoreSetSpec("hf-fp32", engine="hf", dtype="fp32"))
    assert attribution["headlines"] == [] and attribution["engine_gap"] == []
    assert attribution["missing"] == [
        f"add `probe rescore {root} --engine hf --dtype fp32 --repeats 2` for the noise floor of hf training at "
        "fp32 (pass against pass)",
        f"add `probe rescore {root} --engine hf --dtype fp32 --replay r3` for the routing-induced share of hf "
        "training at fp32 (k3 with against without R3)",
        f"add `probe rescore {root} --engine hf --dtype bf16` for a comparison whose variance of delta splits into "
        "each side's error against fp32",
        f"add `probe rescore {root} --engine hf --dtype bf16` for the gap between the rollout's engine (synthetic "
        "inference) and a training engine at the same dtype",
    ]


def test_missing_on_a_dense_run_and_uncompared_engines(tmp_path):
    root, attribution = _sparse_run(
        tmp_path,
        0,
        ScoreSetSpec("hf-bf16", engine="hf", dtype="bf16"),
        ScoreSetSpec("mg-bf16", engine="megatron", dtype="bf16"),
    )
    # Dense: no routing share asked for; the two training engines are compared with the rollout only.
    assert attribution["missing"] == [
        f"add `probe rescore {root} --engine hf --dtype bf16 --repeats 2` for the noise floor of hf training at "
        "bf16 (pass against pass)",
        f"add `probe rescore {root} --engine megatron --dtype bf16 --repeats 2` for the noise floor of megatron "
        "training at bf16 (pass against pass)",
        f"add `probe rescore {root} --engine hf --dtype fp32` to split each comparison's variance of delta into "
        "each side's error against fp32",
        f"run `probe report {root} --pair +scores/hf-bf16:scores/mg-bf16` for the gap between hf and megatron "
        "training at bf16",
    ]
    assert [g["candidate"] for g in attribution["engine_gap"]] == ["scores/hf-bf16", "scores/mg-bf16"]
