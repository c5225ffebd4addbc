"""Mismatch per RL step (issue 34): the per-step split equals a naive recomputation from the Parquet, a
planted jump is named at its step, a flat run names none, a slow rise shows as a trend, and `--workers 2`
gives the steps of one pass."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from frames import assert_close
from naive_metrics import naive_metrics, read_side

from mismatch_probe.errors import ProbeError
from mismatch_probe.record import Recorder
from mismatch_probe.report import numbers
from mismatch_probe.report.build import build_report
from mismatch_probe.report.render.terminal.steps import timeline
from mismatch_probe.report.stream import plan, workers
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

STEPS = 40
PER_STEP = 8  # sequences per step
TOKENS = 40  # response tokens per sequence


def record_run(root, sigma_of_step, seed: int = 0, first_step: int = 0):
    """A Recorder run whose training log-probs are the inference ones plus noise of sd sigma_of_step(step):
    k3 grows about as sigma**2, so a factor f in k3 is a factor sqrt(f) in sigma."""
    rng = np.random.default_rng(seed)
    with Recorder(root) as rec:
        for step in range(first_step, first_step + STEPS):
            for _ in range(PER_STEP):
                lp = rng.uniform(-4.0, -0.05, TOKENS)
                noisy = np.minimum(lp + rng.normal(0.0, sigma_of_step(step), TOKENS), 0.0)
                rec.add([1, 2, 3], rng.integers(0, 100, TOKENS), lp, noisy, step=step)
    return root


def comparison(root, **options) -> dict:
    return build_report(root, render=False, **options).metrics["comparisons"][0]


def test_flat_run_names_no_drift_and_no_trend(tmp_path):
    got = comparison(record_run(tmp_path / "run", lambda step: 0.05))
    assert [s["step"] for s in got["steps"]] == list(range(STEPS))
    assert got["drift"] is None
    low, high = got["trend"]["slope_ci95"]
    assert low < 0 < high


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fivefold_jump_is_named_at_its_step(tmp_path, seed):
    jump = 23 + 100  # step numbers as recorded: they need not start at 0
    got = comparison(record_run(tmp_path / "run", lambda step: 0.05 * (math.sqrt(5) if step >= jump else 1), seed, 100))
    drift = got["drift"]
    assert drift is not None and drift["direction"] == "rise" and drift["shape"] == "jump"
    assert jump - 1 <= drift["step"] <= jump + 1
    assert drift["ratio_ci95"][0] > 1.5 and 3.0 < drift["ratio"] < 8.0
    assert drift["k3_kl_after_ci95"][0] > drift["k3_kl_before_ci95"][1]


def test_a_drop_is_named_as_a_drop(tmp_path):
    got = comparison(record_run(tmp_path / "run", lambda step: 0.1 if step < 15 else 0.03))
    assert got["drift"]["direction"] == "drop" and 14 <= got["drift"]["step"] <= 16
    assert got["drift"]["ratio_ci95"][1] < 1 / 1.5


def test_a_small_step_stays_below_the_ratio(tmp_path):
    got = comparison(record_run(tmp_path / "run", lambda step: 0.05 * (1.1 if step >= 20 else 1)))  # k3 x1.2
    assert got["drift"] is None


def test_a_linear_rise_has_a_positive_trend(tmp_path):
    # ln k3 rises linearly: k3 x e^(0.04) per step, x5 over the run
    got = comparison(record_run(tmp_path / "run", lambda step: 0.03 * math.exp(0.02 * step)))
    trend = got["trend"]
    assert trend["slope_ci95"][0] > 0 and 0.03 < trend["slope"] < 0.05


def test_per_step_keys_equal_a_naive_recomputation(tmp_path):
    root = record_run(tmp_path / "run", lambda step: 0.02 + 0.002 * step)
    got = comparison(root)
    manifest = json.loads((root / "manifest.json").read_text())
    step_of = {sid: step for step, first, last in manifest["steps"] for sid in range(first, last + 1)}
    ref, cand = read_side(root / "rollout"), read_side(root / "scores" / "training")
    for entry in got["steps"]:
        keep = [i for i, row in enumerate(ref) if step_of[row["sample_id"]] == entry["step"]]
        a, b = [ref[i] for i in keep], [cand[i] for i in keep]
        want = naive_metrics(a, b, 0, 0, thresholds=(2,))
        for key in ("n_tokens", "k3_kl", "extreme_fraction@2", "abs_logprob_diff_mean"):
            assert entry[key] == pytest.approx(want[key], rel=1e-9), key
        pairs = [(math.exp(x["logprob"]), math.exp(y["logprob"])) for x, y in zip(a, b) if x["is_response"]]
        assert entry["prob_corr"] == pytest.approx(np.corrcoef(np.array(pairs).T)[0, 1], rel=1e-9)
        low, high = entry["k3_kl_ci95"]
        assert low < entry["k3_kl"] < high


MOE = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=12,
    n_samples=60,
    prompt_len=(2, 6),
    response_len=(3, 40),
    seed=11,
    samples_per_part=25,
    score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.3, route_fraction=0.2),),
)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A routed synthetic run given steps in its manifest: 6 steps of 10 samples, one step's samples in
    two ranges (as interleaved recording writes them)."""
    root = write_synthetic_run(tmp_path_factory.mktemp("steps") / "run", MOE)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["steps"] = [[7, 0, 4], [8, 5, 9], [7, 10, 14]] + [[9 + i, 15 + 9 * i, 23 + 9 * i] for i in range(5)]
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_router_diff_rate_per_step_equals_the_naive_one(moe_run):
    got = comparison(moe_run)
    manifest = json.loads((moe_run / "manifest.json").read_text())
    step_of = {sid: step for step, first, last in manifest["steps"] for sid in range(first, last + 1)}
    ref, cand = read_side(moe_run / "rollout"), read_side(moe_run / "scores" / "bf16")
    assert [s["step"] for s in got["steps"]] == list(range(7, 14))
    for entry in got["steps"]:
        keep = [i for i, row in enumerate(ref) if step_of[row["sample_id"]] == entry["step"]]
        want = naive_metrics([ref[i] for i in keep], [cand[i] for i in keep], 3, 2, thresholds=(2,))
        assert entry["router_diff_rate"] == pytest.approx(want["router_diff_rate"], rel=1e-9)
        assert entry["k3_kl"] == pytest.approx(want["k3_kl"], rel=1e-9)


def test_workers_give_the_steps_of_one_pass(moe_run, monkeypatch):
    single = comparison(moe_run, workers=1)
    monkeypatch.setattr(plan, "MIN_UNIT_ROWS", 100)  # a toy run cut into several units
    pools = []

    class CountedPool(workers.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(workers, "ProcessPoolExecutor", CountedPool)
    split = comparison(moe_run, workers=2)
    assert pools == [2]
    for key in ("steps", "drift", "trend"):
        assert_close(split[key], single[key])


def test_a_run_without_steps_has_no_steps_keys_and_no_timeline(tmp_path):
    root = write_synthetic_run(tmp_path / "run", MOE)
    assert not {"steps", "drift", "trend"} & set(build_report(root).metrics["comparisons"][0])
    assert 'id="steps"' not in (root / "report" / "index.html").read_text()


def test_malformed_steps_in_the_manifest_are_one_line(tmp_path):
    root = write_synthetic_run(tmp_path / "run", MOE)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["steps"] = [[0, 0, 30], [1, 20, 59]]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProbeError, match=r"manifest.json: steps: two sample-id ranges overlap$"):
        comparison(root)


def test_the_drift_ratio_is_an_option_remembered_by_the_run(tmp_path):
    root = record_run(tmp_path / "run", lambda step: 0.05 * (math.sqrt(5) if step >= 23 else 1))
    assert comparison(root, drift_ratio=8)["drift"] is None  # x5 does not clear x8
    assert comparison(root)["drift"] is None  # a plain rerun repeats the last report's options
    assert comparison(root, drift_ratio=1.5)["drift"]["min_ratio"] == 1.5
    with pytest.raises(ProbeError, match=r"^--drift-ratio: 0.5 must be a finite number > 1, e.g. 1.5$"):
        comparison(root, drift_ratio=0.5)


def test_the_terminal_prints_the_timeline_and_the_verdict_names_the_drift(tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    root = record_run(tmp_path / "run", lambda step: 0.05 * (math.sqrt(5) if step >= 23 else 1))
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    text = result.output.replace("\n", " ")
    drift = json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]["drift"]
    assert f"k3 rose {drift['ratio']:.3g}× [" in text and f"from step {drift['step']}" in text
    assert "per step: rollout vs scores/training" in text
    page = (root / "report" / "index.html").read_text()
    assert f"Find what changed at step {drift['step']}" in page
    steps = page[page.index('<section id="steps">') : page.index('<section id="next">')]
    assert steps.count("<svg") == 2 and f"from step {drift['step']}" in steps  # the timeline and its multiples
    assert page.index('<section id="steps">') < page.index('<section id="comparisons">')


def test_the_timeline_bins_beyond_30_rows():
    steps = [
        {
            "step": s,
            "n_tokens": 10 + s,
            "k3_kl": 1e-3 * (s + 1),
            "k3_kl_ci95": [1e-3 * s, 1e-3 * (s + 2)],
            "extreme_fraction@2": 0.0,
            "abs_logprob_diff_mean": 0.01,
            "prob_corr": 0.99,
        }
        for s in range(40)
    ]
    header, rows = timeline(steps)
    assert len(rows) == 30 and "router diff" not in header
    assert rows[0][0] == "0–1" and rows[-1][0] == "39"  # 10 bins of two steps, then single steps
    pooled = (1e-3 * 10 + 2e-3 * 11) / 21
    assert rows[0][2] == numbers.value(pooled)
    assert len(timeline(steps[:12])[1]) == 12


def test_both_sides_carry_a_step_column_that_polars_groups_by(tmp_path):
    import polars as pl
    import pyarrow.parquet as pq

    root = tmp_path / "run"
    with Recorder(root) as rec:
        for step in (5, 5, 9):
            rec.add([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [-0.1, -0.25, -0.3], step=step)
        rec.add([1], [2], [-0.5], [-0.5])  # a sample without a step: null
    for side in ("rollout", "scores/training"):
        path = next((root / side).glob("part-*.parquet"))
        assert pq.read_schema(path).field("step").type == pa.uint32()
        counts = pl.read_parquet(path).group_by("step").len().sort("step", nulls_last=True)
        assert counts.to_dicts() == [{"step": 5, "len": 10}, {"step": 9, "len": 5}, {"step": None, "len": 2}]
    with pytest.raises(ProbeError, match=r"sample 0: step -1, expected a whole number 0 <= step < 2\*\*32$"):
        Recorder(tmp_path / "bad").add([1], [2], [-0.5], [-0.5], step=-1)


def test_a_run_without_steps_has_no_step_column(tmp_path):
    import pyarrow.parquet as pq

    root = tmp_path / "run"
    with Recorder(root) as rec:
        rec.add([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [-0.1, -0.25, -0.3])
    assert "step" not in pq.read_schema(next((root / "rollout").glob("part-*.parquet"))).names


def test_one_sequence_per_step_still_has_a_trend_interval(tmp_path):
    rng = np.random.default_rng(4)
    root = tmp_path / "run"
    with Recorder(root) as rec:
        for step in range(40):
            lp = rng.uniform(-4.0, -0.05, 200)
            sigma = 0.03 * math.exp(0.02 * step)
            rec.add([1], rng.integers(0, 100, 200), lp, np.minimum(lp + rng.normal(0, sigma, 200), 0.0), step=step)
    trend = comparison(root)["trend"]
    assert trend["slope_ci95"] is not None and trend["slope_ci95"][0] > 0
