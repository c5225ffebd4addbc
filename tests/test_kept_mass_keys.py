"""The truncated-sampling keys `kept_logmass_diff_mean` (with its interval) and `n_outside_support`, recomputed
from the Parquet parts by a plain polars + numpy implementation: on synthetic runs with tokens planted outside
a side's support (null log-probs), split across chunks and worker units, and on a real `hf` run sampled with
top-p in processed mode and rescored with `--sampling rollout`. A token outside a side's support must be left
out of k3 and counted, never misaligned: k3 is recomputed over the tokens finite on both sides."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.frames.bootstrap import poisson_weights
from mismatch_probe.report.build import build_report
from mismatch_probe.report.stream import plan
from mismatch_probe.schema import KEPT_LOGMASS
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
KEYS = ("kept_logmass_diff_mean", "kept_logmass_diff_mean_ci95", "n_outside_support")


def side_table(run: Path, side: str) -> pl.DataFrame:
    columns = ["sample_id", "position", "token_id", "is_response", "logprob"]
    if KEPT_LOGMASS in pq.read_schema(next((run / side).glob("part-*.parquet"))).names:
        columns.append(KEPT_LOGMASS)
    return pl.read_parquet(run / side / "*.parquet", columns=columns).sort("sample_id", "position")


def naive(run: Path, ref: str, cand: str) -> dict:
    """The keys from the two sides' Parquet, joined on (sample_id, position): plain formulas, per-sequence sums
    weighted by the Poisson weights of each sample id for the interval."""
    a, b = side_table(run, ref), side_table(run, cand)
    b_named = b.rename({name: name + "_c" for name in b.columns if name not in ("sample_id", "position")})
    joined = a.join(b_named, on=["sample_id", "position"])
    assert joined.height == a.height == b.height and (joined["token_id"] == joined["token_id_c"]).all()
    rows = joined.filter(pl.col("is_response"))
    lp_ref, lp_cand = rows["logprob"].to_numpy(), rows["logprob_c"].to_numpy()  # null -> NaN
    finite = np.isfinite(lp_ref) & np.isfinite(lp_cand)
    d = lp_cand[finite].astype(np.float64) - lp_ref[finite].astype(np.float64)
    out = {"n_tokens": int(finite.sum()), "k3_kl": float(np.mean(np.exp(d) - 1 - d))}
    has = [KEPT_LOGMASS in a.columns, KEPT_LOGMASS in b.columns]
    outside = np.zeros(rows.height, dtype=bool)
    for name, suffix, present in (("logprob", "", has[0]), ("logprob", "_c", has[1])):
        if present:
            kept_col = KEPT_LOGMASS + suffix
            outside |= rows[kept_col].is_not_null().to_numpy() & rows[name + suffix].is_null().to_numpy()
    out["n_outside_support"] = int(outside.sum())
    if all(has):
        both = rows.filter(pl.col(KEPT_LOGMASS).is_not_null() & pl.col(KEPT_LOGMASS + "_c").is_not_null())
        diff = both[KEPT_LOGMASS].cast(pl.Float64) - both[KEPT_LOGMASS + "_c"].cast(pl.Float64)
        out["kept_logmass_diff_mean"] = float(diff.mean())
        per = pl.DataFrame({"s": both["sample_id"], "d": diff}).group_by("s").agg(pl.len(), pl.col("d").sum())
        w = poisson_weights(per["s"].to_numpy().astype(np.int64))
        resampled = (per["d"].to_numpy() @ w) / (per["len"].to_numpy().astype(np.float64) @ w)
        out["kept_logmass_diff_mean_ci95"] = list(np.quantile(resampled, [0.025, 0.975]))
    return out


def check(metrics: dict, expected: dict) -> None:
    assert metrics["n_tokens"] == expected["n_tokens"]
    assert metrics["k3_kl"] == pytest.approx(expected["k3_kl"], rel=1e-9)
    assert metrics["n_outside_support"] == expected["n_outside_support"]
    if "kept_logmass_diff_mean" in expected:
        assert metrics["kept_logmass_diff_mean"] == pytest.approx(expected["kept_logmass_diff_mean"], rel=1e-9)
        assert metrics["kept_logmass_diff_mean_ci95"] == pytest.approx(expected["kept_logmass_diff_mean_ci95"])
    else:
        assert "kept_logmass_diff_mean" not in metrics and "kept_logmass_diff_mean_ci95" not in metrics


SPEC = SyntheticSpec(
    num_layers=2,
    top_k=2,
    num_experts=8,
    n_samples=40,
    response_len=(3, 30),
    seed=3,
    samples_per_part=15,
    kept_logmass=True,
    score_sets=(
        ScoreSetSpec("sampled", kept_logmass=True, outside_support_fraction=0.15, nonfinite_fraction=0.05),
        ScoreSetSpec("raw"),
    ),
)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("kept") / "run", SPEC)
    for path in sorted(root.glob("**/part-*.parquet")):  # row groups that cut sequences: chunks split them
        pq.write_table(pq.read_table(path), path, row_group_size=37)
    return root


def _by_candidate(metrics: dict) -> dict:
    return {c["candidate"]: c for c in metrics["comparisons"]}


def test_planted_nulls_are_counted_and_left_out(synthetic):
    comps = _by_candidate(build_report(synthetic, render=False, workers=1).metrics)
    sampled = comps["scores/sampled"]
    expected = naive(synthetic, "rollout", "scores/sampled")
    assert expected["n_outside_support"] > 20  # planted: 15% of the response tokens
    check(sampled["metrics"], expected)
    m = sampled["metrics"]
    # the tokens outside the support are null log-probs on the candidate side, among the others it has
    assert m["n_null_cand"] == m["n_outside_support"] and m["n_nonfinite_cand"] > 0
    assert m["n_skipped"] == m["n_null_cand"] + m["n_nonfinite_cand"]
    assert any("(n_outside_support)" in note for note in sampled["notes"])
    # a processed rollout against a raw side: the count, no difference of kept masses
    raw = comps["scores/raw"]["metrics"]
    check(raw, naive(synthetic, "rollout", "scores/raw"))
    assert raw["n_outside_support"] == 0


def test_worker_units_merge_to_the_single_pass(synthetic, monkeypatch):
    monkeypatch.setattr(plan, "MIN_UNIT_ROWS", 100)  # a toy run cut into several units
    single = _by_candidate(build_report(synthetic, render=False, workers=1).metrics)
    split = _by_candidate(build_report(synthetic, render=False, workers=2).metrics)
    for side in single:
        got, want = split[side]["metrics"], single[side]["metrics"]
        assert [k for k in KEYS if k in got] == [k for k in KEYS if k in want]
        assert got.get("n_outside_support") == want.get("n_outside_support")
        if "kept_logmass_diff_mean" in want:
            assert got["kept_logmass_diff_mean"] == pytest.approx(want["kept_logmass_diff_mean"], rel=1e-12)
            assert got["kept_logmass_diff_mean_ci95"] == pytest.approx(want["kept_logmass_diff_mean_ci95"], rel=1e-12)


@pytest.mark.parametrize(
    "rollout_kept, score_kept, keys",
    [
        (False, False, ()),  # the demo's case: neither side records it, no key
        (False, True, ("n_outside_support",)),  # an SGLang/vLLM rollout against a --sampling rollout pass
        (True, False, ("n_outside_support",)),  # a processed rollout against a raw pass
        (True, True, KEYS),
    ],
)
def test_keys_appear_only_where_a_side_scored_over_a_truncated_support(tmp_path, rollout_kept, score_kept, keys):
    score = ScoreSetSpec("a", kept_logmass=score_kept, outside_support_fraction=0.2 if score_kept else 0.0)
    spec = SyntheticSpec(num_layers=0, top_k=0, num_experts=0, n_samples=12, kept_logmass=rollout_kept)
    root = write_synthetic_run(tmp_path / "run", replace(spec, score_sets=(score,)))
    (comp,) = build_report(root, render=False, workers=1).metrics["comparisons"]
    assert tuple(k for k in KEYS if k in comp["metrics"]) == tuple(k for k in KEYS if k in keys)
    if keys:
        check(comp["metrics"], naive(root, "rollout", "scores/a"))


def test_a_raw_hf_rollout_records_kept_mass_but_no_key(tmp_path):
    """`hf` writes kept_logmass in raw mode too; against a raw training side that is no truncated comparison."""
    spec = SyntheticSpec(num_layers=0, top_k=0, num_experts=0, n_samples=6, kept_logmass=True)
    root = write_synthetic_run(tmp_path / "run", replace(spec, score_sets=(ScoreSetSpec("a"),)))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["sampling"]["logprobs_mode"] = "raw"
    (root / "manifest.json").write_text(json.dumps(manifest))
    (comp,) = build_report(root, render=False, workers=1).metrics["comparisons"]
    assert not set(KEYS) & set(comp["metrics"])


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_hf_processed_rollout_against_its_sampling_on_the_training_side(tmp_path):
    """Real engines: hf samples with top-p 0.7 in processed mode; a bf16 pass scores with the rollout's top-p
    narrowed to 0.4, so that sampled tokens fall outside the training side's own support (null there)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(8)) + "\n")
    run = tmp_path / "run"
    result = probe(
        "generate", "--model", DEMO_MOE, "--prompts", prompts, "--out", run, "--max-new-tokens", 12, "--seed", 5,
        "--dtype", "fp32", "--top-p", 0.7, "--temperature", 0.9, "--logprobs-mode", "processed",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["sampling"]["top_p"] = 0.4
    (run / "manifest.json").write_text(json.dumps(manifest))
    for args in (("--name", "raw"), ("--name", "sampled", "--sampling", "rollout")):
        result = probe("rescore", run, "--dtype", "bf16", *args)
        assert result.exit_code == 0, result.output
    result = probe("report", run)
    assert result.exit_code == 0, result.output
    comps = _by_candidate(json.loads((run / "report" / "metrics.json").read_text()))
    expected = naive(run, "rollout", "scores/sampled")
    outside = json.loads((run / "scores" / "sampled" / "manifest.json").read_text())["n_outside_support"]
    assert expected["n_outside_support"] == outside > 0
    check(comps["scores/sampled"]["metrics"], expected)
    assert comps["scores/sampled"]["metrics"]["kept_logmass_diff_mean"] > 0  # a narrower support keeps less
    check(comps["scores/raw"]["metrics"], naive(run, "rollout", "scores/raw"))
    assert "kept_logmass_diff_mean" not in comps["scores/raw"]["metrics"]
