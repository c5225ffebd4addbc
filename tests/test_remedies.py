"""Measured remedies (metrics.json `remedies`) on small real runs of the demo MoE model and a sweep.json written
as `probe sweep` writes it: each variant's k3, ratio and interval (paired for training variants, unpaired for
sibling runs) recomputed from the Parquet by naive loops; the significant flag, the speed ratios from the
manifests; an interrupted sweep's variants noted, not fatal; a sweep naming no base refused; the page's and
the terminal's remedies table; and "What to do next" quoting a measured effect or naming the sweep that would."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from browser import CHROMIUM, VIEWPORT_HEIGHT, layout
from naive_metrics import read_side, sequence_deltas
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.frames.bootstrap import RESAMPLES, SEED, poisson_weights
from mismatch_probe.report.numbers import times
from mismatch_probe.report.verdict.actions import next_actions
from mismatch_probe.report.verdict.bands import PUBLISHED
from mismatch_probe.report.verdict.best_remedy import best_remedy, resolved
from mismatch_probe.report.verdict.remedies import SIBLING_SEED
from mismatch_probe.report.verdict.remedy_words import LM_HEAD_FP32, measured_line, size_words
from mismatch_probe.report.verdict.summary import headline_row, rows
from mismatch_probe.rundir.sweep import SweepFile, SweepVariant

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
QUANT = "weight_quant=fp8-block128"


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _ok(result):
    assert result.exit_code == 0, result.output
    return result


VARIANTS = [
    SweepVariant(variant="fp32", side="training", changed={"dtype": "fp32"}, score_set="fp32"),
    SweepVariant(variant="fp16", side="training", changed={"dtype": "fp16"}, score_set="fp16"),
    SweepVariant(variant="again", side="training", changed={"dtype": "bf16"}, score_set="again"),
    SweepVariant(variant="matched", side="training", changed={"weight_quant": "fp8-block128"}, score_set="matched"),
    SweepVariant(variant="sib", side="rollout", changed={"dtype": "fp32"}, run="../sib", score_set="base"),
    SweepVariant(variant="sib-both", side="both", changed={"dtype": "fp32"}, run="../sib", score_set="both"),
    SweepVariant(variant="lost", side="training", changed={"dtype": "fp32"}, score_set="never-written"),
    SweepVariant(variant="gone", side="rollout", changed={"dtype": "fp32"}, run="../absent", score_set="base"),
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """RUN (a bf16 rollout with fp8 weights, so that the bf16 base has a k3 to divide by; base, fp32, fp16 and a
    second bf16 pass), a sibling rollout at fp32 scored by the base (rollout variant) and at fp32 (both), and two
    variants an interrupted sweep never wrote."""
    root = tmp_path_factory.mktemp("remedies")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(16)) + "\n")
    common = ["--model", DEMO_MOE, "--prompts", prompts, "--max-new-tokens", 12, "--seed", 5, "--batch-size", 16]
    run, sib = root / "run", root / "sib"
    _ok(probe("generate", *common, "--dtype", "bf16", "--out", run, "--engine-arg", QUANT))
    for name, dtype in (("base", "bf16"), ("fp32", "fp32"), ("fp16", "fp16"), ("again", "bf16")):
        _ok(probe("rescore", run, "--dtype", dtype, "--name", name))
    _ok(probe("rescore", run, "--dtype", "bf16", "--name", "matched", "--engine-arg", QUANT))  # the rollout's fp8
    _ok(probe("generate", *common, "--dtype", "fp32", "--out", sib, "--engine-arg", QUANT))
    _ok(probe("rescore", sib, "--dtype", "bf16", "--name", "base"))
    _ok(probe("rescore", sib, "--dtype", "fp32", "--name", "both"))
    SweepFile(engine="hf", dtype="bf16", engine_args={}, base="base", variants=VARIANTS).save(run)
    result = _ok(probe("report", run))
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    return root, metrics, result.output


def _by_variant(metrics) -> dict[str, dict]:
    return {e["variant"]: e for e in metrics["remedies"]}


def _sums(rollout: Path, scores: Path) -> dict[int, tuple[float, int]]:
    """sample id -> (sum of k3, compared tokens), by a loop over the rows."""
    seqs = sequence_deltas(read_side(rollout), read_side(scores))
    return {sid: (sum(math.exp(d) - 1 - d for d in deltas), len(deltas)) for sid, deltas in seqs.items()}


def _k3(sums, weights=None) -> float:
    num = sum((1.0 if weights is None else weights[sid]) * k for sid, (k, _) in sums.items())
    den = sum((1.0 if weights is None else weights[sid]) * n for sid, (_, n) in sums.items())
    return num / den


def _resampled(sums, seed) -> list[float]:
    ids = sorted(sums)
    weights = poisson_weights(np.array(ids), seed, RESAMPLES)
    return [_k3(sums, {sid: weights[i, b] for i, sid in enumerate(ids)}) for b in range(RESAMPLES)]


def _percentiles(values) -> list[float]:
    return [float(v) for v in np.quantile(values, [0.025, 0.975])]


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_training_variants_are_paired_and_recomputed(swept):
    root, metrics, _ = swept
    run = root / "run"
    base = _sums(run / "rollout", run / "scores" / "base")
    base_resampled = _resampled(base, SEED)
    for name in ("fp32", "fp16", "matched"):
        entry = _by_variant(metrics)[name]
        variant = _sums(run / "rollout", run / "scores" / name)
        assert (entry["side"], entry["paired"], entry["note"]) == ("training", True, None)
        assert (entry["base"], entry["base_k3_kl"]) == ("scores/base", pytest.approx(_k3(base), rel=1e-9))
        assert entry["n_tokens"] == sum(n for _, n in variant.values())
        assert entry["k3_kl"] == pytest.approx(_k3(variant), rel=1e-9)
        assert entry["ratio"] == pytest.approx(_k3(variant) / _k3(base), rel=1e-9)
        # paired: the same weight for a sequence in both k3 of one resample
        ratios = [v / b for v, b in zip(_resampled(variant, SEED), base_resampled)]
        assert entry["ratio_ci95"] == pytest.approx(_percentiles(ratios), rel=1e-9)
        low, high = entry["ratio_ci95"]
        assert entry["significant"] == (high < 1 or low > 1)
        tps = (
            _manifest(run / "scores" / name)["tokens_per_second"]
            / _manifest(run / "scores" / "base")["tokens_per_second"]
        )
        assert entry["speed_ratio"] == pytest.approx(tps, rel=1e-12)

    matched = _by_variant(metrics)["matched"]  # the trainer sees the rollout's fp8 weights: k3 all but gone
    assert matched["ratio"] < 0.5 and matched["ratio_ci95"][1] < 1 and matched["significant"] is True


def test_a_variant_equal_to_the_base_is_not_significant(swept):
    _, metrics, _ = swept
    again = _by_variant(metrics)["again"]
    assert again["ratio"] == pytest.approx(1.0, abs=1e-12) and again["ratio_ci95"] == pytest.approx([1.0, 1.0])
    assert again["significant"] is False


def test_sibling_variants_are_unpaired_and_recomputed(swept):
    root, metrics, _ = swept
    run, sib = root / "run", root / "sib"
    base = _sums(run / "rollout", run / "scores" / "base")
    base_resampled = _resampled(base, SEED)
    for name, score_set in (("sib", "base"), ("sib-both", "both")):
        entry = _by_variant(metrics)[name]
        variant = _sums(sib / "rollout", sib / "scores" / score_set)
        assert set(variant) == set(base)  # the same prompts and seeds: the same sample ids, other tokens
        assert entry["paired"] is False and entry["run"] == "../sib"
        assert entry["k3_kl"] == pytest.approx(_k3(variant), rel=1e-9)
        assert entry["n_tokens"] == sum(n for _, n in variant.values())
        variant_resampled = _resampled(variant, SIBLING_SEED)  # independent of RUN's weights
        assert entry["k3_kl_ci95"] == pytest.approx(_percentiles(variant_resampled), rel=1e-9)
        assert entry["ratio"] == pytest.approx(_k3(variant) / _k3(base), rel=1e-9)
        ratios = [v / b for v, b in zip(variant_resampled, base_resampled)]
        assert entry["ratio_ci95"] == pytest.approx(_percentiles(ratios), rel=1e-9)
        low, high = entry["ratio_ci95"]
        assert entry["significant"] == (high < 1 or low > 1)
    # the same sample id weighs differently in the two runs: a paired interval would be another, narrower one
    assert not np.array_equal(poisson_weights(np.arange(4), SEED), poisson_weights(np.arange(4), SIBLING_SEED))


def test_speed_ratios_from_the_manifests(swept):
    root, metrics, _ = swept
    run, sib = root / "run", root / "sib"
    g, s = _manifest(run)["tokens_per_second"], _manifest(run / "scores" / "base")["tokens_per_second"]
    g_sib = _manifest(sib)["tokens_per_second"]
    s_both = _manifest(sib / "scores" / "both")["tokens_per_second"]
    assert _by_variant(metrics)["sib"]["speed_ratio"] == pytest.approx(g_sib / g, rel=1e-12)
    combined = (1 / (1 / g_sib + 1 / s_both)) / (1 / (1 / g + 1 / s))
    assert _by_variant(metrics)["sib-both"]["speed_ratio"] == pytest.approx(combined, rel=1e-12)


def test_missing_variants_are_noted_not_fatal(swept):
    root, metrics, _ = swept
    assert [e["variant"] for e in metrics["remedies"]] == [v.variant for v in VARIANTS]
    for name, missing in (("lost", "scores/never-written not found"), ("gone", "run ../absent not found")):
        entry = _by_variant(metrics)[name]
        assert entry["note"] == f"not measured: {missing}"
        assert entry["k3_kl"] is entry["ratio"] is entry["significant"] is entry["speed_ratio"] is None


def test_an_unfinished_training_variant_is_noted_and_the_report_goes_on(swept, tmp_path):
    root, _, _ = swept
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("report"))
    shutil.copytree(root / "sib", tmp_path / "sib")
    manifest = run / "scores" / "fp16" / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"status": "running"}))
    _ok(probe("report", run))
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    fp16 = _by_variant(metrics)["fp16"]
    assert fp16["note"] == "not measured: scores/fp16 unfinished" and fp16["ratio"] is None
    assert _by_variant(metrics)["fp32"]["ratio"] is not None
    assert "scores/fp16" not in {c["candidate"] for c in metrics["comparisons"]}


def test_a_sweep_naming_no_base_is_refused(swept, tmp_path):
    root, _, _ = swept
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("report"))
    SweepFile(engine="hf", dtype="bf16", engine_args={}, base="nope", variants=VARIANTS[:1]).save(run)
    result = probe("report", run)
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: {run / 'sweep.json'}: base score set 'nope' not found in {run / 'scores'} "
        "(score sets: again, base, fp16, fp32, matched)"
    )


def test_a_run_without_sweep_has_no_remedies(swept):
    root, _, _ = swept
    _ok(probe("report", root / "sib"))
    metrics = json.loads((root / "sib" / "report" / "metrics.json").read_text())
    assert list(metrics) == ["schema_version", "comparisons", "request", "attribution", "findings"]
    assert 'id="remedies"' not in (root / "sib" / "report" / "index.html").read_text()


def test_page_and_terminal_show_the_remedies(swept):
    root, metrics, output = swept
    page = (root / "run" / "report" / "index.html").read_text()
    section = page[page.index('<section id="remedies">') : page.index("</section>", page.index('id="remedies"'))]
    assert "<h2>Measured remedies</h2>" in section
    assert section.count("<tr>") == 1 + len(VARIANTS)  # the header and one row per variant
    assert "<td>unpaired</td>" in section and "<td>paired</td>" in section
    assert "base: rollout vs scores/base" in section and "<details>" in section
    assert page.index('id="next"') < page.index('id="remedies"') < page.index('id="findings"')
    assert "measured remedies (probe sweep)" in output
    # the best remedy is the one whose interval lies below 1 (the rollout's fp8 weights on the training side)
    matched = _by_variant(metrics)["matched"]
    best = f"weight_quant=fp8-block128 on the training side: k3 {times(matched['ratio'], matched['ratio_ci95'])}"
    assert f"best remedy: {best} (k3 {size_words(matched['ratio'])})" in output
    assert f"Best remedy: {best} (k3 {size_words(matched['ratio'])})" in page
    # the same sweep without its resolved variants: no remedy is named, the largest point estimate is, with the
    # tokens a pass would need when its point lies below 1
    unresolved = [e for e in metrics["remedies"] if e.get("ratio") is not None and not resolved(e)]
    largest = min(unresolved, key=lambda e: e["ratio"])
    line = best_remedy({"remedies": unresolved})
    assert line.startswith("none: no remedy resolved an effect at this sample size; the largest point estimate is")
    assert f"k3 {times(largest['ratio'], largest.get('ratio_ci95'))} ({largest['variant']})" in line
    assert ("resolving it would take about" in line) == (largest["ratio"] < 1)
    assert "remedies: base: rollout vs scores/base" in output
    for name in ("fp32", "sib-both", "lost"):
        assert name in output


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_remedies_page_fits_the_width(swept, tmp_path):
    root, _, _ = swept
    measured = layout(root / "run" / "report" / "index.html", tmp_path / "profile", 800)
    assert measured["overflow"] <= 0 and 0 < measured["summary-bottom"] <= VIEWPORT_HEIGHT


def test_actions_quote_the_measured_effect_or_the_sweep_that_would(swept):
    root, metrics, _ = swept
    from mismatch_probe.rundir.layout import Run

    run = Run(root / "run")
    infos = run.side_infos()
    table = rows(metrics, infos, PUBLISHED, True)
    head = next(r for r in table if ("rollout", "scores/base") in r.names)
    actions = {a.title: a for a in next_actions(metrics, head, infos, run.root, limit=10)}
    fp16 = _by_variant(metrics)["fp16"]
    invariant = actions["Use fp16, or a batch-invariant inference engine"].effect
    from mismatch_probe.report.numbers import value

    expected = f"{times(fp16['ratio'], fp16['ratio_ci95'])}" + (
        f" (k3 {size_words(fp16['ratio'])})"
        if fp16["significant"]
        else " (the interval includes 1: no effect resolved)"
    )
    assert invariant.startswith(
        f"measured: fp16 weights and compute on the training side: k3 {expected}, "
        f"at {value(fp16['speed_ratio'])}× the speed (fp16); batch invariance unmeasured: the hf rollout engine"
    )
    head_action = actions["Compute the lm_head (logits) in fp32 on both sides"].effect
    assert head_action == (
        f"unmeasured: `probe sweep {run.root} --engine hf --dtype bf16 --vary both:lm_head_dtype=fp32` would measure it"
    )
    assert headline_row(table) is not None


def test_measured_line_words():
    entry = {
        "variant": "hf-bf16-lm_head_dtype-fp32",
        "side": "both",
        "changed": {"lm_head_dtype": "fp32"},
        "ratio": 0.42,
        "ratio_ci95": [0.33, 0.53],
        "significant": True,
        "speed_ratio": 0.97,
    }
    line = measured_line({"remedies": [entry]}, LM_HEAD_FP32, Path("RUN"), "hf", "bf16")
    assert (
        line
        == "measured: lm_head in fp32 on both sides: k3 0.420× [0.330×, 0.530×] (k3 2.4× lower), at 0.970× the speed "
        "(hf-bf16-lm_head_dtype-fp32)"
    )
    nested = entry | {"changed": {"override_transformer_config.lm_head_dtype": "float32"}, "side": "training"}
    rollout = entry | {"side": "rollout", "variant": "r"}
    line = measured_line({"remedies": [rollout, nested]}, LM_HEAD_FP32, Path("RUN"), "hf", "bf16")
    assert "on the training side" in line  # both sides first, then training, then rollout
    unmeasured = measured_line({"remedies": [entry | {"ratio": None}]}, LM_HEAD_FP32, Path("R"), "megatron", "fp32")
    assert (
        unmeasured
        == "unmeasured: `probe sweep R --engine megatron --dtype bf16 --vary both:lm_head_dtype=fp32` would measure it"
    )
