"""The demo's sweep of the MoE model: its rows of the effects table from the report's `remedies`, the sentence
naming the variants that were not significant, and its runs replaced when the demo runs again."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import DEMO_MOE, DEMO_PROMPTS

from mismatch_probe.pipeline.demo.effects import effect_cell, effects, side_cells, sweep_sentence
from mismatch_probe.pipeline.demo.run import DEMO_LAYOUT
from mismatch_probe.pipeline.demo.sweep import SWEEP_ROWS, SWEEP_VARY, sweep_run
from mismatch_probe.pipeline.sweep.knobs import parse_vary
from mismatch_probe.rundir.ownership import foreign_entry

LM_HEAD, ROUTER, EAGER = (f"{row.name} vs the hf bf16 base" for row in SWEEP_ROWS)


def _remedy(side, changed, run, score_set, k3, ci, ratio, ratio_ci):
    """An entry of metrics.json `remedies` as the report writes it."""
    return {
        "variant": f"variant-{score_set}",
        "side": side,
        "changed": changed,
        "run": run,
        "score_set": score_set,
        "paired": run == ".",
        "k3_kl": k3,
        "k3_kl_ci95": ci,
        "ratio": ratio,
        "ratio_ci95": ratio_ci,
        "significant": ratio_ci[0] > 1 or ratio_ci[1] < 1,
        "speed_ratio": 0.9,
    }


BASE = {
    "reference": "rollout",
    "candidate": "scores/hf-bf16",
    "metrics": {"k3_kl": 4e-3, "k3_kl_ci95": [3e-3, 5e-3]},
}
REMEDIES = [
    # the router knob on the training side only: not the demo's row, which changes it on both sides
    _remedy("training", {"router_dtype": "fp32"}, ".", "hf-bf16+router_dtype-fp32", 1e-4, [1e-5, 2e-4], 0.01, [0, 0.1]),
    _remedy(
        "both",
        {"lm_head_dtype": "fp32"},
        "../moe-sweep+rollout.lm_head_dtype-fp32",
        "hf-bf16+lm_head_dtype-fp32",
        2e-3,
        [1e-3, 3e-3],
        0.5,
        [0.3, 0.9],
    ),
    _remedy(
        "both",
        {"router_dtype": "fp32"},
        "../moe-sweep+rollout.router_dtype-fp32",
        "hf-bf16+router_dtype-fp32",
        3.6e-3,
        [2e-3, 5e-3],
        0.9,
        [0.6, 1.2],
    ),
    _remedy(
        "training",
        {"attn_implementation": "eager"},
        ".",
        "hf-bf16+attn_implementation-eager",
        8e-3,
        [6e-3, 1e-2],
        2.0,
        [1.0, 3.0],
    ),
]


def _rows(remedies):
    rows = effects({"moe-sweep": {"comparisons": [BASE], "remedies": remedies}})
    return {row["label"]: row for row in rows if row["key"] == "ratio"}


def test_the_demo_rows_are_the_sweep_s_variants():
    """Each row's side and change are those `probe sweep` records for its --vary (the report's entries are
    matched by them); the sdpa variant is in the sweep, to show it resolves to the base, but has no row."""
    knobs = parse_vary(list(SWEEP_VARY), "hf", "hf")
    assert [(k.side, k.changed) for k in knobs] == [
        *((row.side, row.changed) for row in SWEEP_ROWS),
        ("training", {"attn_implementation": "sdpa"}),
    ]


def test_sweep_rows_read_the_report_s_remedies():
    rows = _rows(REMEDIES)
    assert list(rows) == [LM_HEAD, ROUTER, EAGER]
    lm_head = rows[LM_HEAD]
    assert lm_head["higher"] == ["moe-sweep", "hf-bf16"]  # a remedy: the base is expected higher
    assert lm_head["lower"] == ["moe-sweep+rollout.lm_head_dtype-fp32", "hf-bf16+lm_head_dtype-fp32"]
    assert (lm_head["ratio"], lm_head["ratio_ci95"], lm_head["separates"]) == (0.5, [0.3, 0.9], True)
    assert side_cells(lm_head) == ("4e-3 [3e-3, 5e-3]", "2e-3 [1e-3, 3e-3]")
    assert effect_cell(lm_head) == "fp32 lm_head on both sides vs the hf bf16 base: k3 0.500× [0.300×, 0.900×]"
    router = rows[ROUTER]
    assert (router["lower_value"], router["ratio"], router["separates"]) == (3.6e-3, 0.9, False)  # holds 1
    eager = rows[EAGER]
    assert eager["higher"] == ["moe-sweep", "hf-bf16+attn_implementation-eager"]  # expected to raise k3
    assert side_cells(eager) == ("8e-3 [6e-3, 0.0100]", "4e-3 [3e-3, 5e-3]")
    assert not eager["separates"]  # [1, 3]: an interval touching 1 does not exclude it
    rows = _rows(REMEDIES[:3] + [REMEDIES[3] | {"ratio_ci95": [1.01, 3.0]}])
    assert rows[EAGER]["separates"]
    assert rows[LM_HEAD]["separates"] == REMEDIES[1]["significant"]
    assert _rows(REMEDIES[:3] + [REMEDIES[3] | {"ratio_ci95": [0.2, 0.99]}])[EAGER]["separates"]  # either way


def test_sweep_sentence_names_the_variants_not_significant():
    rows = list(_rows(REMEDIES).values())
    assert sweep_sentence(rows) == (
        "Of the sweep's variants (`moe-sweep`, k3 over the hf bf16 base's), fp32 router on both sides and "
        "eager attention in training, sdpa rollout were not significant: the ratio's interval includes 1."
    )
    significant = [row | {"separates": True} for row in rows]
    assert sweep_sentence(significant) == (
        "Of the sweep's variants (`moe-sweep`, k3 over the hf bf16 base's), every one measured moved k3 "
        "significantly: the ratio's interval excludes 1."
    )


def test_sweep_rows_without_remedies_are_none_and_never_significant():
    """A report written before metrics.json had `remedies`, or a variant the sweep did not finish."""
    for remedies in (None, REMEDIES[:1]):
        rows = _rows(remedies)
        assert [(row["ratio"], row["separates"]) for row in rows.values()] == [(None, False)] * 3
        assert rows[LM_HEAD]["lower"] is None and rows[EAGER]["higher"] is None  # the variant's side
        assert rows[EAGER]["lower"] == ["moe-sweep", "hf-bf16"]  # the base's k3 is the report's own
        assert effect_cell(rows[LM_HEAD]).endswith(": k3 —")
    assert sweep_sentence(list(_rows(None).values())) == (
        "Not measured: fp32 lm_head on both sides, fp32 router on both sides and eager attention in training, "
        "sdpa rollout."
    )


@pytest.mark.slow
def test_a_second_demo_sweep_samples_its_sibling_runs_again(tmp_path):
    """The sweep's run and its sibling runs belong to the demo's folder, and a second demo replaces them: a
    sibling is sampled again rather than reused, and one a demo of other variants left is removed."""
    kwargs = {"num_prompts": 2, "max_new_tokens": 4, "temperature": 2.0, "batches": (8, 8)}
    metrics = sweep_run(tmp_path, DEMO_MOE, DEMO_PROMPTS, **kwargs)["moe-sweep"]
    assert foreign_entry(tmp_path, DEMO_LAYOUT) is None
    sweep = json.loads((tmp_path / "moe-sweep" / "sweep.json").read_text())
    assert [v["score_set"] for v in sweep["variants"]][-1] == "hf-bf16"  # sdpa: the base
    assert [e["score_set"] for e in metrics["remedies"]] == [v["score_set"] for v in sweep["variants"]]
    sibling = tmp_path / "moe-sweep+rollout.lm_head_dtype-fp32"
    manifest = json.loads((sibling / "manifest.json").read_text())
    (sibling / "manifest.json").write_text(json.dumps(manifest | {"created_at": "2000-01-01T00:00:00+00:00"}))
    shutil.copytree(sibling, tmp_path / "moe-sweep+rollout.kv_quant-fp8")
    sweep_run(tmp_path, DEMO_MOE, DEMO_PROMPTS, **kwargs)
    assert json.loads((sibling / "manifest.json").read_text())["created_at"] != "2000-01-01T00:00:00+00:00"
    assert not (tmp_path / "moe-sweep+rollout.kv_quant-fp8").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "moe-sweep",
        "moe-sweep+rollout.lm_head_dtype-fp32",
        "moe-sweep+rollout.router_dtype-fp32",
    ]
