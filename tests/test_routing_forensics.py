"""Routing forensics against a naive per-token loop: k3 over tokens with identical / differing expert sets,
the first differing MoE layer, and routing flips per router-margin bin."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from frames import compare, side_chunk
from naive_metrics import naive_forensics, read_side

from mismatch_probe.report.accumulators.routing_forensics import MARGIN_EDGES, margin_histogram
from mismatch_probe.report.build import build_report
from mismatch_probe.rundir import parts as table_io
from mismatch_probe.schema import RoutingShape
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

SPEC = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=12,
    n_samples=30,
    prompt_len=(2, 6),
    response_len=(3, 12),
    seed=5,
    router_margin=True,
    score_sets=(
        ScoreSetSpec("noisy", logprob_sigma=0.4, route_fraction=0.25, shuffle_order=True, nonfinite_fraction=0.1),
        ScoreSetSpec("quiet", logprob_sigma=0.02, route_fraction=0.05),
        ScoreSetSpec("unrouted", routing=False),
    ),
)
FORENSIC_KEYS = ("first_diff_layer", "n_tokens_routed", "n_tokens_differing")


def _drop_margins(side) -> None:
    for path in sorted(side.glob("part-*.parquet")):
        pq.write_table(pq.read_table(path).drop_columns(["router_margin"]), path)


def _assert_matches(comparison: dict, want: dict, side: str) -> None:
    metrics, forensics = comparison["metrics"], comparison["routing_forensics"]
    for key in ("n_tokens@routing_same", "n_tokens@routing_diff"):
        assert metrics[key] == want[key], key
    for key in ("k3_kl@routing_same", "k3_kl@routing_diff"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-8), key
        low, high = metrics[f"{key}_ci95"]
        assert low <= metrics[key] <= high
    assert {key: forensics[key] for key in FORENSIC_KEYS} == {key: want[key] for key in FORENSIC_KEYS}
    flip = forensics["margin_flip"]
    assert flip == {"side": side, "edges": MARGIN_EDGES.tolist(), "slots": want["slots"], "flips": want["flips"]}


@pytest.mark.parametrize("scope", ["all", "response"])
def test_forensics_match_a_naive_loop(tmp_path, monkeypatch, scope):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    for path in sorted((root / "scores" / "noisy").glob("part-*.parquet")):  # row groups cut sequences
        pq.write_table(pq.read_table(path), path, row_group_size=37)
    _drop_margins(root / "scores" / "quiet")  # its comparison bins the reference side's margins
    monkeypatch.setattr(table_io, "BATCH_ROWS", 16)  # and so do the streamed batches
    report = build_report(
        root, pairs=["rollout:noisy", "rollout:quiet", "rollout:unrouted"], routing_scope=scope, render=False
    )
    by_candidate = {c["candidate"]: c for c in report.metrics["comparisons"]}
    rollout = read_side(root / "rollout")
    for name, side in (("noisy", "candidate"), ("quiet", "reference")):
        want = naive_forensics(rollout, read_side(root / "scores" / name), 3, 2, scope, side, MARGIN_EDGES.tolist())
        assert want["n_tokens@routing_diff"] > 10 and want["n_tokens@routing_same"] > 10  # both splits exercised
        assert sum(want["flips"]) > 0 and want["slots"][0] > 0  # planted flips; exact ties in the underflow bin
        _assert_matches(by_candidate[f"scores/{name}"], want, side)
    noisy = by_candidate["scores/noisy"]["metrics"]
    assert noisy["n_nonfinite_cand"] > 0  # NaN log-probs are left out of both splits
    # every split token is a compared one (finite on both sides), judged by the routing row before it
    assert noisy["n_tokens@routing_same"] + noisy["n_tokens@routing_diff"] <= noisy["n_tokens"]
    unrouted = by_candidate["scores/unrouted"]
    assert unrouted["routing_forensics"] is None
    assert all(
        unrouted["metrics"][f"{stat}@routing_{split}"] is None
        for stat in ("k3_kl", "n_tokens")
        for split in ("same", "diff")
    )
    assert unrouted["metrics"]["k3_kl@routing_same_ci95"] is None


def test_prompt_positions_count_in_the_first_differing_layer_under_scope_all(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    results = {}
    for scope in ("all", "response"):
        comp = build_report(root, pairs=["rollout:noisy"], routing_scope=scope, render=False).metrics["comparisons"][0]
        results[scope] = comp
    all_, response = results["all"], results["response"]
    assert all_["routing_forensics"]["n_tokens_routed"] > response["routing_forensics"]["n_tokens_routed"]
    assert sum(all_["routing_forensics"]["first_diff_layer"]) > sum(response["routing_forensics"]["first_diff_layer"])
    for key in ("n_tokens@routing_same", "k3_kl@routing_same", "n_tokens@routing_diff", "k3_kl@routing_diff"):
        assert all_["metrics"][key] == response["metrics"][key]  # k3 only ever covers response tokens


def test_dense_run_has_null_forensics(tmp_path):
    spec = SyntheticSpec(num_layers=0, top_k=0, num_experts=0, n_samples=4, router_margin=True)
    comp = build_report(write_synthetic_run(tmp_path / "dense", spec), render=False).metrics["comparisons"][0]
    assert comp["routing_forensics"] is None
    for key in (
        "k3_kl@routing_same",
        "k3_kl@routing_diff",
        "n_tokens@routing_same",
        "n_tokens@routing_diff",
        "k3_kl@routing_same_ci95",
        "k3_kl@routing_diff_ci95",
    ):
        assert key in comp["metrics"] and comp["metrics"][key] is None, key


def test_no_margin_column_gives_null_margin_flip(tmp_path):
    spec = SyntheticSpec(**{**SPEC.__dict__, "router_margin": False, "n_samples": 6})
    comp = build_report(write_synthetic_run(tmp_path / "run", spec), pairs=["rollout:noisy"], render=False).metrics[
        "comparisons"
    ][0]
    assert comp["routing_forensics"]["margin_flip"] is None
    assert comp["routing_forensics"]["n_tokens_differing"] > 0


def test_margin_histogram_by_hand():
    margins = np.array([[0.0, 5e-7, 1e-6, 3e-3, 0.99, 1.0], [50.0, 1e4, -0.0, math.nan, math.inf, 1e-2]], np.float32)
    # bins [0,1e-6) [1e-6,1e-5) [1e-5,1e-4) [1e-4,1e-3) [1e-3,1e-2) [1e-2,0.1) [0.1,1) [1,10) [10,100+]
    assert margin_histogram(margins).tolist() == [3, 1, 0, 0, 1, 1, 1, 1, 2]


def test_first_differing_layer_by_hand():
    rows = np.array([True, True, True, False, True])
    # (token, layer) slots whose expert sets differ: (0,1) (0,3) (2,2) (4,0) (4,1) (4,3)
    ref = np.zeros((5, 4, 1), np.uint8)
    cand = ref.copy()
    cand[[0, 0, 2, 4, 4, 4], [1, 3, 2, 0, 1, 3]] = 1
    margins = np.array(
        [[0.5, 2e-6, 0.5, 0.5], [1e-3] * 4, [0.5, 0.5, 0.02, 0.5], [0.0] * 4, [0.0, np.nan, 20, 1]], dtype=np.float32
    )
    lp = np.zeros(5)
    comp = compare(
        [side_chunk([0] * 5, lp, experts=ref, experts_valid=rows)],
        [side_chunk([0] * 5, lp, experts=cand, router_margin=(margins, np.array([1, 1, 1, 1, 0], bool)))],
        shape=RoutingShape(num_layers=4, top_k=1, num_experts=2),
    )
    result = comp.to_json("all")["routing_forensics"]
    assert result["first_diff_layer"] == [1, 1, 1, 0]  # token 4 (no margin row) still counts
    assert (result["n_tokens_routed"], result["n_tokens_differing"]) == (4, 3)
    flip = result["margin_flip"]
    assert flip["side"] == "candidate"
    # 12 slots of rows 0, 1, 2: 1e-3 x4 -> bin 4; 0.5 x6 -> bin 6; 2e-6 -> bin 1; 0.02 -> bin 5
    assert flip["slots"] == [0, 1, 0, 0, 4, 1, 6, 0, 0]
    assert flip["flips"] == [0, 1, 0, 0, 0, 1, 1, 0, 0]  # (0,1) at 2e-6, (0,3) at 0.5, (2,2) at 0.02
