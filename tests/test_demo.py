"""`probe demo` on the shipped trained models shows the effects the tool exists to measure."""

from __future__ import annotations

import json
import re
import runpy
from html import unescape
from pathlib import Path

import pytest
from browser import CHROMIUM, VIEWPORT_HEIGHT, layout
from conftest import DEMO_DENSE, DEMO_MOE, DEMO_PROMPTS
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.pipeline.demo.run import DEMO_LAYOUT
from mismatch_probe.pipeline.demo.sweep import SWEEP_ROWS
from mismatch_probe.report.numbers import with_interval
from mismatch_probe.report.verdict.attribution_text import percent, times
from mismatch_probe.rundir.ownership import foreign_entry

pytestmark = pytest.mark.slow  # the whole demo runs once for the module (about 2-3 minutes)


def test_demo_models_are_shipped():
    for path in (DEMO_MOE / "config.json", DEMO_DENSE / "config.json", DEMO_PROMPTS):
        assert path.is_file(), f"{path}: shipped with the repo, but missing"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(app, ["demo", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = {}
    for kind in ("moe", "dense"):
        data = json.loads((out / kind / "report" / "metrics.json").read_text())
        metrics[kind] = {(c["reference"], c["candidate"]): c["metrics"] for c in data["comparisons"]}
    return out, metrics


def _vs_rollout(metrics, name):
    return metrics[("rollout", f"scores/{name}")]


def test_r3_zeroes_routing_and_cuts_k3(demo):
    _, metrics = demo
    moe = metrics["moe"]
    for plain, replayed in (
        ("hf-bf16", "hf-bf16-r3"),
        ("hf-fp32", "hf-fp32-r3"),
        ("megatron-bf16", "megatron-bf16-r3"),
    ):
        assert _vs_rollout(moe, plain)["router_diff_rate"] > 0
        assert _vs_rollout(moe, replayed)["router_diff_rate"] == 0
        assert _vs_rollout(moe, replayed)["token_diff_rate"] == 0
        assert _vs_rollout(moe, replayed)["k3_kl"] < _vs_rollout(moe, plain)["k3_kl"]


def test_fp32_rescore_has_mismatch_and_extreme_tokens(demo):
    _, metrics = demo
    fp32 = _vs_rollout(metrics["moe"], "hf-fp32")
    assert fp32["k3_kl"] > 0 and fp32["router_diff_rate"] > 0
    assert fp32["extreme_fraction@1.5"] > 0


def test_moe_mismatch_exceeds_dense(demo):
    _, metrics = demo
    for name in ("hf-fp32", "hf-bf16", "megatron-fp32"):
        assert _vs_rollout(metrics["moe"], name)["k3_kl"] > _vs_rollout(metrics["dense"], name)["k3_kl"]


def test_repeated_passes_and_engine_pairs(demo):
    out, metrics = demo
    for kind in ("moe", "dense"):
        assert ("scores/hf-bf16-rep-pass1", "scores/hf-bf16-rep-pass2") in metrics[kind]
        fp32 = metrics[kind][("scores/hf-fp32", "scores/megatron-fp32")]
        assert fp32["abs_logprob_diff_max"] <= 1e-4
        bf16 = metrics[kind][("scores/hf-bf16", "scores/megatron-bf16")]
        assert bf16["abs_logprob_diff_max"] > 1e-3
    assert metrics["moe"][("scores/hf-fp32", "scores/megatron-fp32")]["router_diff_rate"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "hf-fp32" in summary["comparisons"]
    assert (out / "moe" / "report" / "index.html").is_file()
    assert foreign_entry(out, DEMO_LAYOUT) is None  # all of it probe's: a second demo may replace it


def test_worst_tokens_decoded_with_the_demo_tokenizer(demo):
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from transformers import AutoTokenizer

    out, _ = demo
    data = json.loads((out / "moe" / "report" / "metrics.json").read_text())
    by_pair = {(c["reference"], c["candidate"]): c for c in data["comparisons"]}
    plain, replayed = by_pair[("rollout", "scores/hf-fp32")], by_pair[("rollout", "scores/hf-fp32-r3")]
    assert len(plain["worst_tokens"]) == 20 and not any(n.startswith("worst_tokens") for n in plain["notes"])
    assert any(e["routing_diff_layers"] for e in plain["worst_tokens"])
    assert all(e["routing_diff_layers"] in (0, None) for e in replayed["worst_tokens"])  # R3: same experts
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MOE)
    rollout = ds.dataset(sorted((out / "moe" / "rollout").glob("part-*.parquet")))
    for e in plain["worst_tokens"][:5]:
        rows = rollout.to_table(
            columns=["position", "token_id", "is_response"], filter=pc.field("sample_id") == e["sample_id"]
        ).sort_by("position")
        ids, response = rows.column("token_id").to_pylist(), rows.column("is_response").to_pylist()
        prompt_len = response.index(True)
        decode = lambda part: tokenizer.decode(part, clean_up_tokenization_spaces=False)  # noqa: E731
        assert e["token"] == decode([ids[e["position"]]]) and e["response_index"] == e["position"] - prompt_len
        assert e["context"] == {
            "prompt_tail": decode(ids[:prompt_len][-32:]),
            "response_before": decode(ids[prompt_len : e["position"]]),
        }


def _effect_rows(out):
    return json.loads((out / "summary.json").read_text())["effects"]


def test_k3_effects_are_significant(demo):
    out, _ = demo
    rows = [row for row in _effect_rows(out) if row["key"] == "k3_kl"]
    assert len(rows) == 6  # five engine contrasts and stale k3 growing with the policy step
    assert [row["label"] for row in rows if not row["separates"]] == []


def test_policy_staleness_effects_are_significant(demo):
    """The rows the papers predict once the policy moves: R2 adds no bias at step 0, R3 lowers tid k3, stale k3
    grows with the step and mean γ falls with it."""
    out, metrics = demo
    rows = {row["label"]: row for row in _effect_rows(out)}
    policy = [row for label, row in rows.items() if "step" in label]
    assert len(policy) == 4 and all(row["separates"] for row in policy), policy
    assert rows["replay bias at step 0: R3 > R2 (R2's is 0)"]["lower_value"] == 0
    comps = json.loads((out / "moe" / "report" / "metrics.json").read_text())["comparisons"]
    staleness = {(c["policy_step"], c["replay"]) for c in comps if c.get("kind") == "policy"}
    assert staleness == {(0, "r2"), (0, "r3")} | {(s, r) for s in (1, 2, 4, 8) for r in ("none", "r2", "r3")}
    page = (out / "moe" / "report" / "index.html").read_text()
    assert "Policy staleness" in page


def test_fp32_extreme_fraction_rests_on_enough_tokens(demo):
    out, _ = demo
    (row,) = [row for row in _effect_rows(out) if row["key"] == "extreme_fraction@2"]
    assert row["extreme_tokens"] >= 20 and row["separates"]


def _comparison(name, k3, ci, extreme=None, n=1000):
    metrics = {"k3_kl": k3, "k3_kl_ci95": ci, "n_tokens": n}
    if extreme is not None:
        metrics |= {"extreme_fraction@2": extreme, "extreme_fraction@2_ci95": [extreme / 2, extreme * 2]}
    return {"reference": "rollout", "candidate": f"scores/{name}", "metrics": metrics}


def test_effects_separate_only_when_intervals_do_not_overlap():
    from mismatch_probe.pipeline.demo.effects import effects

    moe = [
        _comparison("hf-bf16", 1e-3, [5e-4, 2e-3]),
        _comparison("hf-fp32", 2e-3, [1.1e-3, 3e-3], extreme=0.02),
        _comparison("hf-bf16-r3", 1e-4, [5e-5, 5e-4]),
        _comparison("hf-fp32-r3", 1e-4, [5e-5, 1.2e-3]),
    ]
    dense = [_comparison("hf-bf16", 1e-4, [5e-5, 4e-4]), _comparison("hf-fp32", 1e-4, [5e-5, 1e-3])]
    rows = {row["label"]: row for row in effects({"moe": {"comparisons": moe}, "dense": {"comparisons": dense}})}
    assert rows["MoE k3 > dense k3, hf bf16"]["separates"]  # 5e-4 > 4e-4
    assert rows["MoE k3 > dense k3, hf fp32"]["separates"]  # 1.1e-3 > 1e-3
    assert not rows["no R3 k3 > R3 k3, hf bf16"]["separates"]  # 5e-4 == 5e-4: touching intervals overlap
    assert not rows["no R3 k3 > R3 k3, hf fp32"]["separates"]  # 1.1e-3 < 1.2e-3
    assert not rows["no R3 k3 > R3 k3, megatron bf16"]["separates"]  # missing comparisons never separate
    extreme = rows["MoE fp32 F(2) rests on >= 20 extreme tokens"]
    assert extreme["extreme_tokens"] == 20 and extreme["separates"]


def _share_entry(share, low, high, plain="scores/hf-bf16", matched="scores/hf-bf16-quant"):
    return {
        "plain": plain,
        "matched": matched,
        "k3_kl_plain": 4e-3,
        "k3_kl_plain_ci95": [3e-3, 5e-3],
        "k3_kl_matched": 4e-3 * (1 - share),
        "k3_kl_matched_ci95": [3e-3 * (1 - share), 5e-3 * (1 - share)],
        "share": share,
        "share_ci95": [low, high],
    }


def test_share_rows_separate_only_when_the_share_interval_lies_above_zero():
    from mismatch_probe.pipeline.demo.effects import effect_cell, effects, side_cells

    def rows_for(fp8_entries, topp_entries):
        results = {
            "moe-fp8": {"attribution": {"quant_share": fp8_entries}},
            "moe-topp": {"attribution": {"truncation_share": topp_entries}},
        }
        return {row["key"]: row for row in effects(results) if "share" in row}

    fp32 = _share_entry(0.9, 0.5, 0.95, plain="scores/hf-fp32", matched="scores/hf-fp32-quant")  # not the row's pair
    sampled = _share_entry(0.05, -0.01, 0.2, plain="scores/hf-fp32", matched="scores/hf-fp32-sampled")
    rows = rows_for([fp32, _share_entry(0.8, 0.01, 0.9)], [sampled])
    fp8, topp = rows["quant_share"], rows["truncation_share"]
    assert (fp8["share"], fp8["share_ci95"], fp8["separates"]) == (0.8, [0.01, 0.9], True)
    assert fp8["higher"] == ["moe-fp8", "hf-bf16"] and fp8["lower"] == ["moe-fp8", "hf-bf16-quant"]
    assert (topp["share"], topp["separates"]) == (0.05, False)  # -1% to 20%: the interval holds 0
    assert side_cells(fp8) == ("4e-3 [3e-3, 5e-3]", "8e-4 [6e-4, 1e-3]")
    assert effect_cell(fp8) == f"{fp8['label']}: quant_share 80.0% [1.0%, 90.0%]"  # bounds at the point's precision
    assert not rows_for([], [])["quant_share"]["separates"]  # a report without the pair never separates
    assert rows_for([], [])["quant_share"]["share"] is None


def test_production_rollouts_state_their_shares(demo):
    """The fp8 and top-p rollouts: each share row is its report's attribution entry for the plain and matched
    passes, significant, and the manifests record what made each rollout a production one."""
    out, _ = demo
    rows = {row["key"]: row for row in _effect_rows(out) if row["key"] in ("quant_share", "truncation_share")}
    assert set(rows) == {"quant_share", "truncation_share"}
    for key, run, plain, matched in (
        ("quant_share", "moe-fp8", "hf-bf16", "hf-bf16-quant"),
        ("truncation_share", "moe-topp", "hf-fp32", "hf-fp32-sampled"),
    ):
        row = rows[key]
        attribution = json.loads((out / run / "report" / "metrics.json").read_text())["attribution"]
        (entry,) = [
            e for e in attribution[key] if (e["plain"], e["matched"]) == (f"scores/{plain}", f"scores/{matched}")
        ]
        assert (row["share"], row["share_ci95"]) == (entry["share"], entry["share_ci95"])
        assert (row["higher_value"], row["lower_value"]) == (entry["k3_kl_plain"], entry["k3_kl_matched"])
        assert row["separates"] and entry["share_ci95"][0] > 0, row
    rollout = json.loads((out / "moe-fp8" / "manifest.json").read_text())
    quant = rollout["quantization"]
    assert (quant["weight"], quant["act"]) == ("fp8-block128", "fp8-token128") and quant["quantized_modules"]
    scores = out / "moe-fp8" / "scores"
    assert json.loads((scores / "hf-bf16" / "manifest.json").read_text())["quantization"] is None
    matched = json.loads((scores / "hf-bf16-quant" / "manifest.json").read_text())["quantization"]
    assert matched["quantized_modules"] == quant["quantized_modules"]
    sampling = json.loads((out / "moe-topp" / "manifest.json").read_text())["sampling"]
    assert (sampling["top_p"], sampling["logprobs_mode"], sampling["temperature"]) == (0.7, "processed", 1.0)
    sampled = json.loads((out / "moe-topp" / "scores" / "hf-fp32-sampled" / "manifest.json").read_text())
    assert sampled["sampling"]["logprobs_mode"] == "processed"


def test_sweep_rows_are_the_sweep_report_s_remedies(demo):
    """The MoE sweep: sweep.json and its sibling runs exist, sdpa resolved to the base, and each row of the effects
    table states its variant's `remedies` entry: k3 and its interval, the ratio to the base's with its interval,
    significant exactly when the report says so (the ratio's interval excludes 1)."""
    out, _ = demo
    sweep = json.loads((out / "moe-sweep" / "sweep.json").read_text())
    assert [(v["side"], v["changed"], v["score_set"]) for v in sweep["variants"]] == [
        ("both", {"lm_head_dtype": "fp32"}, "hf-bf16+lm_head_dtype-fp32"),
        ("both", {"router_dtype": "fp32"}, "hf-bf16+router_dtype-fp32"),
        ("training", {"attn_implementation": "eager"}, "hf-bf16+attn_implementation-eager"),
        ("training", {"attn_implementation": "sdpa"}, "hf-bf16"),
    ]
    for knob in ("lm_head_dtype-fp32", "router_dtype-fp32"):
        sibling = out / f"moe-sweep+rollout.{knob}"
        assert json.loads((sibling / "manifest.json").read_text())["status"] == "complete"
        assert {p.name for p in (sibling / "scores").iterdir()} == {"hf-bf16", f"hf-bf16+{knob}"}
    metrics = json.loads((out / "moe-sweep" / "report" / "metrics.json").read_text())
    remedies = {(e["side"], json.dumps(e["changed"])): e for e in metrics["remedies"]}
    rows = [row for row in _effect_rows(out) if row["key"] == "ratio"]
    assert len(rows) == 3
    for row, spec in zip(rows, SWEEP_ROWS, strict=True):
        entry = remedies[(spec.side, json.dumps(spec.changed))]
        variant, base = ("higher", "lower") if spec.raises else ("lower", "higher")  # the expected higher first
        assert [row[f"{variant}_value"], row[f"{variant}_ci95"]] == [entry["k3_kl"], entry["k3_kl_ci95"]], row
        assert row[f"{base}_value"] == entry["base_k3_kl"]
        assert (row["ratio"], row["ratio_ci95"], row["separates"]) == (
            entry["ratio"],
            entry["ratio_ci95"],
            entry["significant"],
        )
    assert remedies[("training", json.dumps({"attn_implementation": "sdpa"}))]["ratio"] == 1


def test_a_plain_report_rerun_keeps_the_demo_comparisons(demo):
    """The demo's report adds the engine pairs to the defaults; the run remembers it, so a plain rerun
    computes the same comparisons (12 on the MoE run with megatron installed)."""
    out, metrics = demo
    result = CliRunner().invoke(app, ["report", str(out / "moe")])
    assert result.exit_code == 0, result.output
    rerun = json.loads((out / "moe" / "report" / "metrics.json").read_text())
    assert [(c["reference"], c["candidate"]) for c in rerun["comparisons"]] == list(metrics["moe"])
    assert ("scores/hf-bf16", "scores/megatron-bf16") in metrics["moe"]


def test_demo_attribution_states_all_four_kinds(demo):
    out, _ = demo
    attribution = json.loads((out / "moe" / "report" / "metrics.json").read_text())["attribution"]
    floor = attribution["noise_floor"][0]
    assert (floor["reference"], floor["candidate"]) == ("scores/hf-bf16-rep-pass1", "scores/hf-bf16-rep-pass2")
    shares = {(s["without_replay"], s["with_replay"]) for s in attribution["routing_share"]}
    assert shares == {
        ("scores/hf-bf16", "scores/hf-bf16-r3"),
        ("scores/hf-fp32", "scores/hf-fp32-r3"),
        ("scores/megatron-bf16", "scores/megatron-bf16-r3"),
    }
    assert all(s["share_ci95"][0] > 0 for s in attribution["routing_share"])  # R3 cuts k3 significantly
    assert ("rollout", "scores/hf-bf16", "scores/hf-fp32") in {
        (e["reference"], e["candidate"], e["fp32"]) for e in attribution["numerics"]
    }
    gaps = {(g["reference"], g["candidate"]) for g in attribution["engine_gap"]}
    assert {("scores/hf-fp32", "scores/megatron-fp32"), ("rollout", "scores/hf-bf16")} <= gaps
    kinds = ("noise_floor", "routing_share", "numerics", "engine_gap")
    assert len(attribution["headlines"]) == sum(len(attribution[k]) for k in kinds)


def test_compare_on_the_two_demo_runs(demo, tmp_path):
    out, _ = demo
    result = CliRunner().invoke(app, ["compare", str(out / "moe"), str(out / "dense"), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["moe", "dense"]
    assert (tmp_path / "index.html").is_file()


def test_demo_page_states_noise_floor_r3_share_and_engine_gap_from_metrics(demo):
    out, _ = demo
    report = out / "moe" / "report"
    attribution = json.loads((report / "metrics.json").read_text())["attribution"]
    html = (report / "index.html").read_text()
    findings = unescape(re.sub(r"<[^>]+>", "", html[html.index('id="findings"') : html.index('<section class="card"')]))
    for line in attribution["headlines"]:
        assert line in findings
    floor, share = attribution["noise_floor"][0], attribution["routing_share"][0]
    gap = next(g for g in attribution["engine_gap"] if g["noise_floor"])
    assert with_interval(floor["k3_kl"], floor["k3_kl_ci95"]) in findings
    assert percent(share["share"], share["share_ci95"]) in findings
    assert with_interval(gap["k3_kl"], gap["k3_kl_ci95"]) in findings
    assert times(gap["ratio_to_noise_floor"], gap["ratio_to_noise_floor_ci95"]) in findings


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
@pytest.mark.parametrize("width", [1280, 800])
def test_demo_page_fits_the_screen(demo, tmp_path, width):
    """The MoE demo's page (12 engine comparisons and the policy staleness section of 14 policy passes): at most
    10,000 px tall at 1280 px (about 9,600 measured; the staleness section takes about 1,100 of them), no sideways
    scroll at either width, the verdict and summary table on the first screen, figure text at 11 px or more."""
    out, _ = demo
    measured = layout(out / "moe" / "report" / "index.html", tmp_path / "profile", width)
    assert 0 < measured["summary-bottom"] <= VIEWPORT_HEIGHT
    assert measured["overflow"] <= 0
    assert measured["smallest-font"] >= 11, measured["smallest-text"]
    if width == 1280:
        assert measured["height"] <= 10_000


def test_recorded_effects_are_those_of_a_fresh_demo(demo):
    """docs/demo-effects.json (the README's table) states the same effects, separating the same way."""
    out, _ = demo
    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "effects_table.py"))
    fresh, recorded = script["demo_rows"](out), json.loads(script["RECORDED"].read_text())
    assert [(r["label"], r["separates"]) for r in fresh] == [(r["label"], r["separates"]) for r in recorded]


def test_demo_is_healthy_for_the_doctor(demo):
    """Every comparison of the demo is ordinary mismatch: `probe doctor` finds no setup bug in it (a declared
    quantized or truncated rollout is a known setting, not a finding)."""
    out, _ = demo
    for kind in ("moe", "dense", "moe-fp8", "moe-topp", "moe-sweep"):
        assert json.loads((out / kind / "report" / "metrics.json").read_text())["findings"] == []
        result = CliRunner().invoke(app, ["doctor", str(out / kind)])
        assert result.exit_code == 0, result.output


def test_demo_prints_and_keeps_each_step_s_wall_time(demo):
    out, _ = demo
    wall = json.loads((out / "summary.json").read_text())["wall_time"]
    first = {row["step"]: row["seconds"] for row in wall["steps"]}
    second = {row["step"]: row["seconds"] for row in wall["beside"]}
    for step in ("moe: generate", "moe: rescore hf-fp32", "moe: policy checkpoints", "moe: report"):
        assert first[step] > 0, step
    for step in ("dense: generate", "dense: report", "moe-fp8: rescore hf-bf16-quant", "moe-sweep: report"):
        assert second[step] > 0, step
    # The MoE passes handed to the second process ran there, once each, and the MoE report read them.
    handed = [f"moe: rescore {name}" for name in ("hf-bf16-rep", "megatron-fp32", "megatron-bf16", "megatron-bf16-r3")]
    assert all(second[step] > 0 and step not in first for step in handed)
    compared = {
        c["candidate"] for c in json.loads((out / "moe" / "report" / "metrics.json").read_text())["comparisons"]
    }
    assert {"scores/hf-bf16-rep-pass2", "scores/megatron-fp32", "scores/megatron-bf16-r3"} <= compared
    # Each process's steps are its time: the longer one's nearly all of the total, and neither exceeds it.
    assert 0.8 * wall["total"] <= max(sum(first.values()), sum(second.values()))
    assert sum(first.values()) <= wall["total"] and sum(second.values()) <= wall["total"]
