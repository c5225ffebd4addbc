"""verl's definitions under verl's names, by hand on three sequences: an empty row, abs(delta) > 20, a
sequence sum past 20. (tests/test_verl_parity.py checks the same keys against verl itself, where it installs.)"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.report.build import build_report
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

CAND = "scores/cand"
# Two response tokens per sequence; dyadic log-probs, exact in float32. delta = cand - ref:
# sequence 0: 0.25, 0.375; sequence 1: -25, 1 (sum -24); sequence 2: no finite candidate log-prob (empty to verl).
REF = [-0.5, -0.5, -1.0, -1.5, -1.0, -1.0]
CANDIDATE = [-0.25, -0.125, -26.0, -0.5, math.nan, math.nan]


@pytest.fixture(scope="module")
def metrics(tmp_path_factory) -> dict:
    spec = SyntheticSpec(
        n_samples=3,
        num_layers=0,
        top_k=0,
        num_experts=0,
        prompt_len=(1, 1),
        response_len=(2, 2),
        score_sets=(ScoreSetSpec("cand"),),
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("hand") / "run", spec)
    for side, values in (("rollout", REF), (CAND, CANDIDATE)):
        (path,) = (root / side).glob("part-*.parquet")
        table = pq.read_table(path)
        response = table.column("is_response").to_numpy()
        logprob = np.zeros(len(response), dtype=np.float32)
        logprob[response] = values
        i = table.schema.get_field_index("logprob")
        pq.write_table(table.set_column(i, table.schema.field(i), pa.array(logprob, mask=~response)), path)
    report = build_report(
        root, pairs=[("rollout", CAND)], tis_caps=["2", "1.5"], geo_bounds=["2", "20000"], render=False
    )
    return report.metrics["comparisons"][0]["metrics"]


def test_sequence_keys_average_over_every_sequence_an_empty_one_as_zero(metrics):
    # -mean(delta) per sequence: -0.3125, 12, and 0 for the empty one; three rows, not two.
    assert metrics["log_ppl_diff"] == pytest.approx((-0.3125 + 12 + 0) / 3)
    assert metrics["log_ppl_abs_diff"] == pytest.approx((0.3125 + 12 + 0) / 3)
    assert metrics["log_ppl_diff_max"] == pytest.approx(12) and metrics["log_ppl_diff_min"] == pytest.approx(-0.3125)
    assert metrics["ppl_ratio"] == pytest.approx((math.exp(-0.3125) + math.exp(12) + 1) / 3)
    # the sum of sequence 1 (-24) clamped to -20
    assert metrics["chi2_seq"] == pytest.approx((math.expm1(1.25) + math.expm1(-40) + 0) / 3)
    assert metrics["ppl_ref"] == pytest.approx((math.exp(0.5) + math.exp(1.25) + 1) / 3)
    assert metrics["log_ppl_cand"] == pytest.approx((0.1875 + 13.25 + 0) / 3)


def test_token_weights_are_clamped_at_20_then_truncated_at_the_cap(metrics):
    raw = np.exp([0.25, 0.375, -20.0, 1.0])  # -25 clamped to -20
    w = np.minimum(raw, 2.0)
    assert metrics["is_ess@2"] == pytest.approx(w.sum() ** 2 / (4 * (w * w).sum()))
    assert metrics["is_mean@2"] == pytest.approx(w.mean()) and metrics["is_std@2"] == pytest.approx(w.std())
    assert metrics["is_min@2"] == pytest.approx(math.exp(-20)) and metrics["is_max@2"] == 2.0
    assert metrics["is_fraction_low@2"] == 0.25 and metrics["tis_clip_fraction@2"] == 0.25
    assert metrics["icepop_oob_fraction@2"] == 0.5
    # uncapped, unclamped: probe's own ESS
    r = np.exp([0.25, 0.375, -25.0, 1.0])
    assert metrics["is_ess"] == pytest.approx(r.sum() ** 2 / (4 * (r * r).sum()))
    seq = np.array([w[:2].mean(), w[2:].mean(), 0.0])
    assert metrics["is_seq_mean@2"] == pytest.approx(seq.mean())
    assert metrics["is_seq_std@2"] == pytest.approx(seq.std(ddof=1))
    assert metrics["is_seq_max_deviation@2"] == pytest.approx(1.0)  # the empty row's 0
    assert metrics["is_seq_fraction_low@2"] == pytest.approx(1 / 3)  # the empty row only
    # rollout_is: sequence: W = min(exp(clamped sum), C) on each token: sums 0.625 and -24 (clamped to -20)
    weights = np.array([math.exp(0.625)] * 2 + [math.exp(-20)] * 2)
    assert metrics["seq_is_mean@2"] == pytest.approx(weights.mean()) and metrics["seq_is_std@2"] == pytest.approx(
        weights.std()
    )
    assert metrics["seq_is_ess@2"] == pytest.approx(weights.sum() ** 2 / (4 * (weights**2).sum()))
    assert metrics["seq_is_fraction_low@2"] == pytest.approx(1 / 3)  # sequence 1 of all three
    # sequence-level weights exp(sum delta): sequence 0's sum 0.625 lies between log 1.5 and log 2
    assert metrics["seq_tis_clip_fraction@1.5"] == pytest.approx(1 / 3) and metrics["seq_tis_clip_fraction@2"] == 0


def test_seq_mean_k1_clamps_per_token_where_the_geometric_filter_does_not(metrics):
    # sequence 1: mean delta -12, but mean of clamped delta -9.5; log(20000) = 9.9 lies between.
    assert metrics["seq_geo_reject_fraction@20000"] == 0.5
    assert metrics["seq_mean_k1_reject_fraction@20000"] == 0.0
    assert metrics["seq_geo_reject_fraction@2"] == metrics["seq_mean_k1_reject_fraction@2"] == 0.5
    assert metrics["mult_prob_error"] == pytest.approx(np.mean(np.exp([0.25, 0.375, 25.0, 1.0])))
    assert metrics["seq_sum_k1_reject_fraction@20000"] == 0.5  # sequence 1: sum(-clamped delta) = 19 > 9.9


def test_rejection_statistics_per_sequence(metrics):
    # clamped deltas: sequence 0: 0.25, 0.375; sequence 1: -20, 1; the empty sequence is left out.
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    seq_max_k3 = np.array([k3(0.375), k3(-20)])
    assert metrics["rs_seq_mean@seq_max_k3"] == pytest.approx(seq_max_k3.mean())
    assert metrics["rs_seq_max@seq_max_k2"] == pytest.approx(200.0)
    assert metrics["rs_seq_min@seq_sum_k1"] == pytest.approx(-0.625)
    seq_mean_k2 = np.array([(0.25**2 + 0.375**2) / 4, (400 + 1) / 4])
    assert metrics["rs_seq_std@seq_mean_k2"] == pytest.approx(seq_mean_k2.std(ddof=1))
    assert metrics["rs_mean@seq_mean_k2"] == pytest.approx(seq_mean_k2.mean())  # both have two tokens


def test_sequence_level_raw_weight_extremes_and_debug_metrics(metrics):
    # rollout_is: sequence logs exp(sum of unclamped delta) over every row: 0.625, -24 and the empty row's 0
    assert metrics["seq_is_max@2"] == pytest.approx(math.exp(0.625)) and metrics["is_max@2"] == 2.0
    assert metrics["seq_is_min@2"] == pytest.approx(math.exp(-24))
    # rollout_rs: seq_sum_k1's largest |statistic|: sequence 1's -(-20 + 1) = 19 (the empty sequence left out)
    assert metrics["rs_seq_max_deviation@seq_sum_k1"] == pytest.approx(19.0)
    # calculate_debug_metrics: |p_cand - p_ref| over the compared tokens, its torch.std (n - 1)
    diff = np.abs(np.exp(np.array(CANDIDATE[:4])) - np.exp(np.array(REF[:4])))
    assert metrics["abs_prob_diff_std"] == pytest.approx(diff.std(ddof=1))
    assert metrics["abs_prob_diff_mean"] == pytest.approx(diff.mean())
    # every response token has a log-prob on both sides (a NaN is a value): all six differ, the NaNs too
    assert metrics["logprob_bit_mismatch_count"] == 6 and metrics["logprob_bit_mismatch_fraction"] == 1.0
