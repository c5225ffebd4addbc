"""Correction what-ifs and bootstrap intervals against a naive per-sequence implementation."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from frames import assert_close, cut, metrics, side_chunk
from naive_metrics import (
    naive_bootstrap_interval,
    naive_corrections,
    naive_k3,
    read_side,
    sequence_deltas,
)
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.frames.bootstrap import poisson_weights
from mismatch_probe.report.build import build_report
from mismatch_probe.report.numbers import interval, with_interval
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

CAND = "scores/noisy"


def _plant(root, edit) -> None:
    """Rewrite the candidate's log-probs in place: edit(sample_id, is_response, logprob) -> new logprob."""
    for part in sorted((root / CAND).glob("part-*.parquet")):
        table = pq.read_table(part)
        sid = table.column("sample_id").to_numpy()
        response = table.column("is_response").to_numpy(zero_copy_only=False)
        lp = table.column("logprob").to_numpy(zero_copy_only=False).astype(np.float32)
        new = pa.array(edit(sid, response, lp), type=pa.float32(), mask=~response)
        table = table.set_column(table.schema.get_field_index("logprob"), "logprob", new)
        pq.write_table(table, part, row_group_size=777)  # row groups that cut sequences


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Per-token noise, per-sequence shifts (sequence keys), a few huge deltas (clamps) and non-finite values."""
    spec = SyntheticSpec(
        n_samples=160,
        response_len=(4, 60),
        score_sets=(ScoreSetSpec("noisy", logprob_sigma=0.2, nonfinite_fraction=0.01),),
        seed=3,
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("corr") / "run", spec)
    rng = np.random.default_rng(7)
    shift = rng.normal(0.0, 0.05, size=spec.n_samples)

    def edit(sid, response, lp):
        lp = np.minimum(lp + shift[sid].astype(np.float32), 0.0)
        huge = np.flatnonzero(response & np.isfinite(lp))[::97]
        lp[huge] = -35.0  # delta far below -20: exercises the chi2 clamp, r ~ 0
        return lp

    _plant(root, edit)
    report = build_report(
        root, pairs=[("rollout", CAND)], tis_caps=["1.2", "1.5"], geo_bounds=["1.001", "1.05"], render=False
    )
    sequences = list(sequence_deltas(read_side(root / "rollout"), read_side(root / CAND)).values())
    return report.metrics["comparisons"][0]["metrics"], sequences


def test_every_correction_key_matches_the_naive_implementation(planted):
    metrics, sequences = planted
    naive = naive_corrections(sequences, caps=("1.2", "1.5"), bounds=("1.001", "1.05"))
    assert metrics["tis_clip_fraction@1.5"] > 0 and metrics["seq_geo_reject_fraction@1.001"] > 0
    for key, value in naive.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert metrics["k3_kl"] == pytest.approx(naive_k3(sequences), rel=1e-9)


def test_intervals_sit_beside_their_keys_and_cover_the_point(planted):
    metrics, _ = planted
    keys = list(metrics)
    for key in (
        "k3_kl",
        "k1_kl",
        "k2_kl",
        "abs_logprob_diff_mean",
        "extreme_fraction@2",
        "router_diff_rate",
        "token_diff_rate",
        "log_ppl_diff",
        "chi2_seq",
        "is_ess",
        "tis_clip_fraction@1.2",
        "seq_geo_reject_fraction@1.05",
    ):
        low, high = metrics[f"{key}_ci95"]
        assert keys.index(f"{key}_ci95") == keys.index(key) + 1
        assert low <= metrics[key] <= high and low < high, key
    assert "abs_logprob_diff_max_ci95" not in metrics and "n_tokens_ci95" not in metrics


@pytest.mark.parametrize(
    "key, statistic",
    [
        ("k3_kl", naive_k3),
        ("log_ppl_diff", lambda seqs: naive_corrections(seqs)["log_ppl_diff"]),
        ("is_ess", lambda seqs: naive_corrections(seqs)["is_ess"]),
        ("tis_clip_fraction@1.2", lambda seqs: naive_corrections(seqs, caps=("1.2",))["tis_clip_fraction@1.2"]),
        ("chi2_token", lambda seqs: naive_corrections(seqs)["chi2_token"]),
    ],
)
def test_interval_width_agrees_with_a_naive_bootstrap(planted, key, statistic):
    metrics, sequences = planted
    sequences = [s for s in sequences if s]
    low, high = naive_bootstrap_interval(sequences, statistic, resamples=1000, seed=11)
    ours = metrics[f"{key}_ci95"][1] - metrics[f"{key}_ci95"][0]
    assert ours == pytest.approx(high - low, rel=0.25), (metrics[f"{key}_ci95"], (low, high))


def test_weights_are_poisson_and_depend_only_on_seed_and_sample_id():
    ids = np.arange(5000)
    w = poisson_weights(ids, seed=1, resamples=300)
    assert w.mean() == pytest.approx(1.0, abs=0.01) and w.var() == pytest.approx(1.0, abs=0.02)
    assert (w == 0).mean() == pytest.approx(math.exp(-1), abs=0.01)
    np.testing.assert_array_equal(poisson_weights(ids[1234:1240], seed=1, resamples=300), w[1234:1240])
    assert not np.array_equal(poisson_weights(ids[:50], seed=2, resamples=300), w[:50])
    assert np.corrcoef(w[:-1].ravel(), w[1:].ravel())[0, 1] == pytest.approx(0.0, abs=0.01)


def test_results_do_not_depend_on_where_chunks_cut_sequences():
    rng = np.random.default_rng(0)
    sid = np.repeat(np.arange(40), rng.integers(1, 30, size=40))
    lp_ref = -rng.exponential(0.3, size=len(sid))
    lp_cand = lp_ref + rng.normal(0, 0.3, size=len(sid))
    valid = rng.random(len(sid)) < 0.9
    ref, cand = side_chunk(sid, lp_ref), side_chunk(sid, np.minimum(lp_cand, 0), valid=valid)
    whole = metrics([ref], [cand])
    for cuts in ([1, 2, 50, 51, 300], list(range(7, len(sid), 7))):
        assert_close(metrics(cut(ref, cuts), cut(cand, cuts)), whole)


def test_report_options_for_caps_and_bounds(planted, tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(n_samples=8))
    result = CliRunner().invoke(app, ["report", str(root), "--tis-caps", "3", "--geo-bounds", "1.02"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]
    low, high = metrics["k3_kl_ci95"]
    assert with_interval(metrics["k3_kl"], [low, high]) in result.output  # the terminal table
    html = (root / "report" / "index.html").read_text()
    headers = [h.replace("<wbr>", "") for h in re.findall(r"<th>(.*?)</th>", html)]
    assert "tis_clip_fraction@3" in headers and "seq_geo_reject_fraction@1.02" in headers
    assert interval([low, high]) in html and "_ci95" not in html
    bad = CliRunner().invoke(app, ["report", str(root), "--geo-bounds", "0.9"])
    assert bad.exit_code == 2
    assert bad.output.strip() == "error: --geo-bounds: 0.9 must be a finite number > 1, e.g. 1.001,1.01"
