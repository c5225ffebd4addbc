"""Property test: any valid run, however shaped, gives a report whose metrics stay in their ranges."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from frames import with_null_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_probe.report.build import build_report
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.slow  # hypothesis draws many synthetic runs

RATES = ("argmax_flip_rate", "router_diff_rate", "token_diff_rate")
NON_NEGATIVE = (
    "k3_kl",
    "k2_kl",
    "abs_logprob_diff_mean",
    "abs_logprob_diff_max",
    "abs_prob_diff_mean",
    "abs_prob_diff_max",
    "router_diff_mean",
    "token_diff_mean",
    "seq_router_diff_mean",
)


@st.composite
def specs(draw):
    moe = draw(st.booleans())
    top_k = draw(st.integers(1, 4)) if moe else 0
    num_experts = draw(st.sampled_from([top_k, top_k + 1, 16, 300])) if moe else 0
    prompt_lo = draw(st.integers(1, 4))
    response_lo = draw(st.integers(0, 3))
    score_sets = tuple(
        ScoreSetSpec(
            f"s{i}",
            logprob_sigma=draw(st.sampled_from([0.0, 1e-3, 0.3, 3.0])),
            route_fraction=draw(st.sampled_from([0.0, 0.1, 1.0])),
            shuffle_order=draw(st.booleans()),
            nonfinite_fraction=draw(st.sampled_from([0.0, 0.1, 1.0])),
            routing=draw(st.booleans()),
            repeat_group="rep",
            pass_index=i + 1,
        )
        for i in range(draw(st.integers(1, 2)))
    )
    return SyntheticSpec(
        num_layers=draw(st.integers(1, 3)) if moe else 0,
        top_k=top_k,
        num_experts=num_experts,
        n_samples=draw(st.integers(1, 6)),
        prompt_len=(prompt_lo, prompt_lo + draw(st.integers(0, 4))),
        response_len=(response_lo, response_lo + draw(st.integers(0, 6))),
        seed=draw(st.integers(0, 2**16)),
        samples_per_part=draw(st.integers(1, 4)),
        score_sets=score_sets,
    )


def _null_some(root: Path, fraction: float, seed: int) -> None:
    """Null a random share of the score sets' log-probs and routing, as engines that lack them do."""
    rng = np.random.default_rng(seed)
    for part in sorted((root / "scores").glob("*/part-*.parquet")):
        table = pq.read_table(part)
        for name in ("logprob", "experts"):
            i = table.schema.get_field_index(name)
            col = table.column(i).combine_chunks()
            drop = rng.random(len(col)) < fraction
            mask = pa.array(col.is_null().to_numpy(zero_copy_only=False) | drop)
            new = with_null_rows(col, mask.to_numpy(zero_copy_only=False))
            table = table.set_column(i, table.schema.field(i), new)
        pq.write_table(table, part)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), null_fraction=st.sampled_from([0.0, 0.3]))
def test_report_metrics_stay_in_range(spec, null_fraction):
    with tempfile.TemporaryDirectory() as tmp:
        root = write_synthetic_run(Path(tmp) / "run", spec)
        if null_fraction:
            _null_some(root, null_fraction, spec.seed)
        rollout = pq.read_table(root / "rollout", columns=["is_response"])
        response_rows = int(np.count_nonzero(rollout.column(0).to_numpy()))
        report = build_report(root, render=False)

        assert len(report.metrics["comparisons"]) == len(spec.score_sets) + (len(spec.score_sets) - 1)
        for comp in report.metrics["comparisons"]:
            m = comp["metrics"]
            assert m["n_tokens"] <= m["n_response_tokens"] == response_rows
            assert m["n_tokens"] + m["n_skipped"] == response_rows
            extreme = [key for key in m if key.startswith("extreme_fraction@") and not key.endswith("_ci95")]
            for key in (key for key in m if key.endswith("_ci95")):  # intervals contain their point estimate
                point = m[key.removesuffix("_ci95")]
                assert (m[key] is None) == (point is None)
                if point is not None:  # up to rounding: resamples that all equal the point may differ in the last bit
                    low, high = m[key]
                    slack = 1e-12 * max(abs(low), abs(high), abs(point))
                    assert low - slack <= point <= high + slack, (key, point, m[key])
            for key in (*RATES, *extreme):
                assert m[key] is None or 0.0 <= m[key] <= 1.0, (key, m[key])
            for key in NON_NEGATIVE:
                assert m[key] is None or m[key] >= 0.0, (key, m[key])
            if m["n_tokens"]:
                assert m["abs_logprob_diff_mean"] <= m["abs_logprob_diff_max"]
                assert m["abs_prob_diff_mean"] <= m["abs_prob_diff_max"] <= 1.0
                fractions = [m[key] for key in extreme]  # thresholds 1.5, 2, 5, 10: F can only fall
                assert fractions == sorted(fractions, reverse=True)
            else:
                assert m["k3_kl"] is None
            if m["router_diff_rate"] is not None:
                width = spec.num_layers * spec.top_k
                assert m["router_diff_mean"] <= spec.top_k and m["token_diff_mean"] <= width
                assert m["seq_router_diff_mean"] <= width
                assert m["router_diff_rate"] <= m["token_diff_rate"] + 1e-12
                assert 0 < m["n_routing_tokens"] <= len(rollout)
            elif spec.num_layers:
                assert any("routing" in note for note in comp["notes"])
