"""quant_share and truncation_share (issue 40) on small real runs of the demo MoE model, each recomputed from
the Parquet by a naive loop; the band a quantized or truncated rollout is judged by, the actions it gets, the
missing lines that name the pass measuring each share, and an unquantized raw run left as it was."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from naive_metrics import read_side, sequence_deltas
from test_attribution import _k3, _naive_paired_interval
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report
from mismatch_probe.report.verdict.actions import next_actions
from mismatch_probe.report.verdict.bands import PUBLISHED, QUANTIZED, place
from mismatch_probe.report.verdict.production import quantized_sides
from mismatch_probe.report.verdict.summary import headline_row, rows, verdict
from mismatch_probe.rundir.layout import Run

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
QUANT = "weight_quant=fp8-block128"


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _ok(result):
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("production")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(12)) + "\n")
    common = ["--model", DEMO_MOE, "--prompts", prompts, "--max-new-tokens", 12, "--seed", 5, "--batch-size", 12]
    _ok(probe("generate", *common, "--dtype", "bf16", "--out", root / "quant", "--engine-arg", QUANT))
    _ok(probe("rescore", root / "quant", "--dtype", "fp32", "--name", "plain"))
    _ok(probe("rescore", root / "quant", "--dtype", "fp32", "--name", "matched", "--engine-arg", QUANT))
    trunc = ["--top-p", 0.7, "--temperature", 1.0, "--logprobs-mode", "processed"]
    _ok(probe("generate", *common, "--dtype", "bf16", *trunc, "--out", root / "trunc"))
    _ok(probe("rescore", root / "trunc", "--dtype", "fp32", "--name", "plain"))
    _ok(probe("rescore", root / "trunc", "--dtype", "fp32", "--name", "sampled", "--sampling", "rollout"))
    _ok(probe("generate", *common, "--dtype", "bf16", "--out", root / "plain"))
    _ok(probe("rescore", root / "plain", "--dtype", "fp32", "--name", "plain"))
    return root


def _check_share(root: Path, entry: dict, plain: str, matched: str):
    rollout = read_side(root / "rollout")
    without = sequence_deltas(rollout, read_side(root / "scores" / plain))
    with_fix = sequence_deltas(rollout, read_side(root / "scores" / matched))
    assert (entry["plain"], entry["matched"]) == (f"scores/{plain}", f"scores/{matched}")
    assert entry["k3_kl_plain"] == pytest.approx(_k3(without), rel=1e-9)
    assert entry["k3_kl_matched"] == pytest.approx(_k3(with_fix), rel=1e-9)
    assert entry["share"] == pytest.approx(1 - _k3(with_fix) / _k3(without), rel=1e-9)
    expected = _naive_paired_interval(with_fix, without, lambda ratio: 1 - ratio)
    assert entry["share_ci95"] == pytest.approx(expected, rel=1e-9)


def test_quant_share_recomputed_from_the_parquet(runs):
    root = runs / "quant"
    result = _ok(probe("report", root))
    metrics = json.loads((root / "report" / "metrics.json").read_text())
    attribution = metrics["attribution"]
    assert "truncation_share" not in attribution
    [entry] = attribution["quant_share"]
    assert (entry["weight"], entry["act"], entry["engine"], entry["dtype"]) == ("fp8-block128", None, "hf", "fp32")
    _check_share(root, entry, "plain", "matched")
    assert 0 < entry["share"] < 1  # the matched pass removes most of the quantization's k3
    sentence = attribution["headlines"][0]
    assert sentence.startswith("Weight quantization (fp8-block128) explains ")
    assert "weight quantization (fp8-block128) explains" in verdict_of(root, metrics)
    assert "weight quantization (fp8-block128) explains" in result.output  # the terminal's verdict
    page = (root / "report" / "index.html").read_text()
    assert "Weight quantization (fp8-block128) explains" in page
    for title in ("Keep the routers and lm_head unquantized", "Prefer block or MX scales", "bf16-rounded weights"):
        assert title in page
    assert not [line for line in attribution["missing"] if "weight_quant" in line]


def verdict_of(root: Path, metrics: dict) -> str:
    run = Run(root)
    table = rows(metrics, run.side_infos(), PUBLISHED, run.manifest().routing.is_moe, quantized_sides(run))
    return verdict(metrics, table)


def test_quantized_rollout_is_judged_by_its_own_band_and_advised(runs):
    root = runs / "quant"
    metrics = build_report(root, render=False).metrics
    run = Run(root)
    assert quantized_sides(run) == {"rollout", "scores/matched"}
    strict = replace(PUBLISHED, acceptable=1e-12)  # so that the band, not the acceptable level, decides
    table = rows(metrics, run.side_infos(), strict, True, quantized_sides(run))
    by_cand = {row.names[0][1]: row for row in table}
    assert "quantized-rollout band" in by_cand["scores/plain"].placement.where  # one side quantized
    assert "MoE band" in by_cand["scores/matched"].placement.where  # both quantized alike: the numerics' band
    assert place(QUANTIZED.high * 2, None, None, strict, True, quantized=True).word == "act"
    assert place(QUANTIZED.high / 2, None, None, strict, True, quantized=True).word == "watch"
    actions = next_actions(metrics, headline_row(table), run.side_infos(), root)
    titles = [a.title for a in actions]
    for start in ("Keep the routers", "Prefer block or MX", "Quantize from the bf16", "Correct the rest with"):
        assert any(t.startswith(start) for t in titles), titles
    tis = next(a for a in actions if a.title.startswith("Correct the rest"))
    assert tis.how["nemo_rl"] == "loss_fn.use_importance_sampling_correction=true"


def test_truncation_share_recomputed_and_judged_after_it(runs):
    root = runs / "trunc"
    metrics = build_report(root, render=False).metrics
    attribution = metrics["attribution"]
    assert "quant_share" not in attribution
    [entry] = attribution["truncation_share"]
    _check_share(root, entry, "plain", "sampled")
    assert entry["share"] > 0.5  # processed log-probs against raw ones: truncation is most of k3
    assert attribution["headlines"][0].startswith("Truncated sampling (top-p/top-k) explains ")
    run = Run(root)
    table = rows(metrics, run.side_infos(), PUBLISHED, True, quantized_sides(run))
    head = headline_row(table)
    assert head.names[0][1] == "scores/plain"
    assert "once truncation is matched" in head.placement.where
    after = place(entry["k3_kl_matched"], entry["k3_kl_matched_ci95"], None, PUBLISHED, True)
    assert head.placement.word == after.word and head.placement.where.startswith(after.where)
    assert "truncated sampling explains" in verdict(metrics, table)
    actions = next_actions(metrics, head, run.side_infos(), root)
    assert any(a.title.startswith("Compare like with like") and "--sampling rollout" in a.how["probe"] for a in actions)


def test_missing_lines_name_the_pass_for_each_share(runs):
    quant = build_report(runs / "quant", pairs=["rollout:scores/plain"], render=False).metrics["attribution"]
    assert quant["quant_share"] == []
    [line] = [m for m in quant["missing"] if "weight_quant" in m]
    assert "--engine-arg weight_quant=fp8-block128" in line and "quantization (fp8-block128) explains" in line
    trunc = build_report(runs / "trunc", pairs=["rollout:scores/plain"], render=False).metrics["attribution"]
    assert trunc["truncation_share"] == []
    [line] = [m for m in trunc["missing"] if "--sampling rollout" in m]
    assert "truncated sampling" in line


def test_an_unquantized_raw_rollout_has_no_new_keys(runs):
    root = runs / "plain"
    metrics = build_report(root, render=False).metrics
    attribution = metrics["attribution"]
    assert "quant_share" not in attribution and "truncation_share" not in attribution
    assert not [m for m in attribution["missing"] if "weight_quant" in m or "--sampling rollout" in m]
    assert not [h for h in attribution["headlines"] if "explains" in h and "quantization" in h]
    run = Run(root)
    assert quantized_sides(run) == set()
    table = rows(metrics, run.side_infos(), PUBLISHED, True, quantized_sides(run))
    assert table == rows(metrics, run.side_infos(), PUBLISHED, True)
    titles = [a.title for a in next_actions(metrics, headline_row(table), run.side_infos(), root)]
    assert not [t for t in titles if "quantiz" in t or "like with like" in t]


def _legend(page: str) -> str:
    start = page.index('<p class="legend">')
    return " ".join(page[start : page.index("</p>", start)].split())


def _between(page: str, start: str, end: str) -> str:
    first = page.index(start)
    return page[first : page.index(end, first)]


def test_the_report_shows_each_sides_quantization_and_sampling(runs):
    raw = "sampling T=1 top_p=1 top_k=0 raw"
    fp8 = "weight fp8-block128, act none, kv none"
    expected = {
        "quant": {
            "rollout": f"{fp8}; {raw}",
            "scores/plain": f"not quantized; {raw}",
            "scores/matched": f"{fp8}; {raw}",
        },
        "trunc": {
            "rollout": "not quantized; sampling T=1 top_p=0.7 top_k=0 processed",
            "scores/plain": f"not quantized; {raw}",
            "scores/sampled": "not quantized; sampling T=1 top_p=0.7 top_k=0 processed",
        },
    }
    for name, sides in expected.items():
        result = _ok(probe("report", runs / name, "--pair", f"rollout:{sorted(sides)[1]}"))
        setup = [line for line in result.output.splitlines() if line.startswith("setup: ")]
        assert setup == [f"setup: {side}: {sides[side]}" for side in sorted(sides)]  # rollout, then by name
        page = (runs / name / "report" / "index.html").read_text()
        run_section = _between(page, '<section id="run">', "</section>")
        for side, line in sides.items():
            assert f"<td>{side}</td><td>" in run_section and f"<td>{line}</td>" in run_section
        cards = _between(page, '<section id="comparisons">', '<section id="together">')
        production = [line for line in sides.values() if not line.startswith(f"not quantized; {raw}")]
        assert all(line in cards for line in production)  # a quantized or truncated side's card names it
    # the plain run, as the demo: no setup line in the terminal, none in the cards; the folded table has them
    result = _ok(probe("report", runs / "plain"))
    assert "setup: " not in result.output
    page = (runs / "plain" / "report" / "index.html").read_text()
    assert "sampling T=" not in _between(page, '<section id="verdict">', '<section id="run">')
    assert f"<td>not quantized; {raw}</td>" in _between(page, '<section id="run">', "</section>")


def test_the_legend_names_the_band_each_comparison_is_judged_by(runs):
    from mismatch_probe.report import numbers

    quantized = f"the quantized-rollout band ({numbers.value(QUANTIZED.low)}..{numbers.value(QUANTIZED.high)})"
    moe = f"the MoE band ({numbers.value(PUBLISHED.moe.low)}..{numbers.value(PUBLISHED.moe.high)})"
    # rollout vs plain has one side quantized, rollout vs matched both: the legend names both bands
    legend = _legend(build_page(runs / "quant", ["rollout:scores/plain", "rollout:scores/matched"]))
    assert f"inside {moe}, or {quantized} where one side is quantized;" in legend
    only = _legend(build_page(runs / "quant", ["rollout:scores/plain"]))
    assert f"inside {quantized};" in only and "MoE band" not in only
    for name, pairs in (
        ("trunc", ["rollout:scores/plain", "rollout:scores/sampled"]),
        ("plain", ["rollout:scores/plain"]),
    ):
        legend = _legend(build_page(runs / name, pairs))
        assert f"inside {moe};" in legend and "quantized-rollout" not in legend


def build_page(root: Path, pairs: list[str]) -> str:
    return build_report(root, pairs=pairs).index_path.read_text()
