"""Known-answer tests of every SPEC section 5 metric against a hand computation or a naive second implementation."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from frames import assert_close, compare, cut, metrics, side_chunk
from naive_metrics import naive_metrics, read_side

from mismatch_probe.frames.expert_sets import expert_bit_table, expert_set_diff
from mismatch_probe.report.accumulators.probability import CURVE_T
from mismatch_probe.report.build import build_report
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.schema import RoutingShape
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run


def test_extreme_keys_print_threshold_as_given():
    assert [EXTREME_FRACTION.at(t) for t in (1.5, 2, 5.0, 10, "2.50")] == [
        "extreme_fraction@1.5",
        "extreme_fraction@2",
        "extreme_fraction@5",
        "extreme_fraction@10",
        "extreme_fraction@2.50",
    ]


def test_probability_metrics_by_hand():
    # r = p_cand / p_ref = 0.4, 1, 3 on the three usable tokens; the rest are excluded and counted.
    p_ref = np.array([0.5, 0.5, 0.2, 0.3, 0.3, np.nan, 0.7])
    p_cand = np.array([0.2, 0.5, 0.6, np.inf, 0.1, 0.4, 0.9])
    lp_ref = np.log(p_ref).astype(np.float32)
    lp_cand = np.log(p_cand).astype(np.float32)
    lp_cand[3] = np.nan  # non-finite on the candidate
    response = np.array([1, 1, 1, 1, 1, 1, 0], dtype=bool)  # last one is a prompt token (of its own sample)
    ref_valid = np.array([1, 1, 1, 1, 1, 1, 0], dtype=bool)
    cand_valid = np.array([1, 1, 1, 1, 0, 1, 0], dtype=bool)  # token 4: null on the candidate
    top_ref = (np.array([1, 2, 3, 4, 5, 6, 7]), np.ones(7, bool))
    top_cand = (np.array([1, 9, 3, 4, 5, 6, 0]), np.array([1, 1, 1, 1, 1, 0, 1], bool))
    sample = [0, 0, 0, 0, 0, 0, 1]
    comp = compare(
        [side_chunk(sample, lp_ref, is_response=response, valid=ref_valid, top=top_ref)],
        [side_chunk(sample, lp_cand, is_response=response, valid=cand_valid, top=top_cand)],
    )
    m = comp.to_json("all")["metrics"]
    assert m["n_tokens"] == 3
    assert m["n_skipped"] == 3 and m["n_response_tokens"] == 6
    assert (m["n_nonfinite_ref"], m["n_nonfinite_cand"], m["n_null_ref"], m["n_null_cand"]) == (1, 1, 0, 1)
    assert m["k3_kl"] == pytest.approx(((0.4 - 1 - math.log(0.4)) + 0 + (3 - 1 - math.log(3))) / 3, rel=1e-6)
    assert m["k1_kl"] == pytest.approx((-math.log(0.4) - math.log(3)) / 3, rel=1e-6)
    assert m["k2_kl"] == pytest.approx(0.5 * (math.log(0.4) ** 2 + math.log(3) ** 2) / 3, rel=1e-6)
    assert m["abs_logprob_diff_mean"] == pytest.approx((-math.log(0.4) + math.log(3)) / 3, rel=1e-6)
    assert m["abs_logprob_diff_max"] == pytest.approx(math.log(3), rel=1e-6)
    assert m["abs_prob_diff_mean"] == pytest.approx((0.3 + 0 + 0.4) / 3, rel=1e-6)
    assert m["abs_prob_diff_max"] == pytest.approx(0.4, rel=1e-6)
    # max(r, 1/r) = 2.5, 1, 3
    assert m["extreme_fraction@1.5"] == pytest.approx(2 / 3)
    assert m["extreme_fraction@2"] == pytest.approx(2 / 3)
    assert m["extreme_fraction@5"] == 0 and m["extreme_fraction@10"] == 0
    # Top ids compared on response positions where both have them (5 of 6): one flip.
    assert m["n_argmax_compared"] == 5 and m["argmax_flip_rate"] == pytest.approx(1 / 5)
    curve = comp.probability.curve()
    at = {round(t, 6): f for t, f in zip(curve["t"], curve["fraction"])}
    assert at[2.0] == pytest.approx(2 / 3) and at[1.0] == pytest.approx(2 / 3) and at[100.0] == 0


def test_argmax_flip_rate_is_null_without_top_ids():
    zeros = [side_chunk([0, 0, 0], np.zeros(3))]
    m = metrics(zeros, zeros)
    assert m["argmax_flip_rate"] is None and m["k3_kl"] == 0.0


def test_empty_comparison_gives_null_metrics():
    none = [side_chunk([0, 0], np.zeros(2), is_response=[False, False])]
    m = metrics(none, none)
    assert m["n_tokens"] == 0 and m["k3_kl"] is None and m["extreme_fraction@2"] is None
    assert m["k3_kl_ci95"] is None


def test_routing_metrics_by_hand_with_more_than_64_experts():
    # 2 layers, top-2, 130 experts (3 bitmask words). Rows: sample 0 = t0..t2, sample 1 = t3, t4.
    ref = np.array(
        [
            [[1, 2], [3, 4]],  # t0 identical
            [[5, 100], [129, 64]],  # t1 same sets, shuffled order: no difference
            [[1, 2], [3, 4]],  # t2 layer 1: one expert differs
            [[65, 129], [0, 1]],  # t3 layer 0: both experts differ
            [[1, 2], [3, 4]],  # t4 no routing on the reference (last position)
        ],
        dtype=np.uint8,
    )
    cand = np.array(
        [
            [[1, 2], [3, 4]],
            [[100, 5], [64, 129]],
            [[1, 2], [3, 70]],
            [[66, 128], [0, 1]],
            [[9, 9], [9, 9]],
        ],
        dtype=np.uint8,
    )
    sample = [0, 0, 0, 1, 1]
    ref_valid = np.array([1, 1, 1, 1, 0], bool)
    shape = RoutingShape(num_layers=2, top_k=2, num_experts=130)
    lp = np.zeros(5)
    comp = compare(
        [side_chunk(sample, lp, experts=ref, experts_valid=ref_valid)],
        [side_chunk(sample, lp, experts=cand)],
        shape=shape,
    )
    m = comp.to_json("all")["metrics"]
    assert m["n_routing_tokens"] == 4 and m["n_routing_sequences"] == 2
    assert m["router_diff_rate"] == pytest.approx(2 / 8)
    assert m["router_diff_mean"] == pytest.approx(3 / 8)
    assert m["token_diff_rate"] == pytest.approx(2 / 4)
    assert m["token_diff_mean"] == pytest.approx(3 / 4)
    assert m["seq_router_diff_mean"] == pytest.approx((1 / 3 + 2 / 1) / 2)
    hist = comp.to_json("all")["routing_histograms"]
    assert hist["router"] == [6, 1, 1]
    assert hist["token"] == [2, 1, 1, 0, 0]
    assert hist["per_layer_router_diff_rate"] == pytest.approx([1 / 4, 1 / 4])
    assert sum(hist["sequence"]["counts"]) == 2


def test_routing_scope_response_restricts_positions():
    ref = np.zeros((3, 1, 2), np.uint8) + np.array([0, 1], np.uint8)
    cand = ref.copy()
    cand[0, 0, 1] = 7  # a prompt position differs
    response = [False, True, True]
    sides = [[side_chunk([0, 0, 0], np.zeros(3), is_response=response, experts=e)] for e in (ref, cand)]
    m = metrics(*sides, shape=RoutingShape(num_layers=1, top_k=2, num_experts=8), routing_scope="response")
    assert m["router_diff_rate"] == 0 and m["n_routing_tokens"] == 2


def test_routing_split_across_chunks_keeps_sequence_sums():
    rng = np.random.default_rng(1)
    ref = np.stack([rng.permutation(32)[:4] for _ in range(60)]).astype(np.uint8).reshape(20, 3, 4)
    cand = ref.copy()
    cand[rng.random((20, 3)) < 0.3] = np.arange(28, 32, dtype=np.uint8)[::-1]
    sample = np.repeat(np.arange(4), 5)
    lp = -rng.exponential(0.3, size=20)
    shape = RoutingShape(num_layers=3, top_k=4, num_experts=32)
    whole_ref, whole_cand = side_chunk(sample, lp, experts=ref), side_chunk(sample, lp * 1.1, experts=cand)
    whole = compare([whole_ref], [whole_cand], shape=shape).to_json("all")
    parts = compare(cut(whole_ref, [3, 11]), cut(whole_cand, [3, 11]), shape=shape).to_json(
        "all"
    )  # cuts inside sequences
    assert parts["routing_histograms"] == whole["routing_histograms"]
    assert_close(parts["metrics"], whole["metrics"])


def test_expert_set_diff_is_order_insensitive_against_sets():
    rng = np.random.default_rng(0)
    for num_experts in (8, 64, 65, 200):
        ref = np.stack([rng.permutation(num_experts)[:6] for _ in range(300)]).astype(np.uint8)
        cand = np.stack([rng.permutation(np.r_[r[:3], rng.permutation(num_experts)[:3]]) for r in ref]).astype(np.uint8)
        got = expert_set_diff(ref, cand, expert_bit_table(num_experts))
        want = [6 - len(set(a) & set(b)) for a, b in zip(ref.tolist(), cand.tolist())]
        assert got.tolist() == want


SPEC = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=70,
    n_samples=40,
    prompt_len=(2, 6),
    response_len=(3, 12),
    seed=3,
    score_sets=(
        ScoreSetSpec("noisy", logprob_sigma=0.4, route_fraction=0.2, shuffle_order=True, nonfinite_fraction=0.05),
        ScoreSetSpec("quiet", logprob_sigma=0.02, route_fraction=0.02),
    ),
)


@pytest.mark.parametrize("scope", ["all", "response"])
def test_report_matches_naive_on_synthetic_run(tmp_path, scope):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    # Different row-group boundaries on the two sides: alignment must go by row offset.
    side = root / "scores" / "noisy"
    for path in sorted(side.glob("part-*.parquet")):
        table = pq.read_table(path)
        pq.write_table(table, path, row_group_size=37)
    report = build_report(root, routing_scope=scope, render=False)
    by_pair = {(c["reference"], c["candidate"]): c["metrics"] for c in report.metrics["comparisons"]}
    rollout = read_side(root / "rollout")
    for name in ("noisy", "quiet"):
        want = naive_metrics(rollout, read_side(root / "scores" / name), 3, 2, scope=scope)
        got = by_pair[("rollout", f"scores/{name}")]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
    noisy = by_pair[("rollout", "scores/noisy")]
    assert noisy["n_nonfinite_cand"] > 0 and noisy["n_skipped"] == noisy["n_nonfinite_cand"]
    assert noisy["extreme_fraction@1.5"] > 0  # the planted noise is large enough to show
    # The rollout has no routing at each sequence's last position; the scores do.
    n_rows = len(rollout) if scope == "all" else sum(r["is_response"] for r in rollout)
    assert noisy["n_routing_tokens"] == n_rows - SPEC.n_samples


def test_curve_matches_extreme_fraction_at_grid_points(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    report = build_report(root, pairs=["rollout:noisy"], thresholds=(1.5, 2, 5, 10), render=False)
    comp = report.metrics["comparisons"][0]
    curve = dict(zip(np.round(comp["extreme_fraction_curve"]["t"], 9), comp["extreme_fraction_curve"]["fraction"]))
    for t in (2, 5, 10):
        assert curve[float(t)] == pytest.approx(comp["metrics"][f"extreme_fraction@{t}"])
    assert len(CURVE_T) == len(comp["extreme_fraction_curve"]["fraction"])
