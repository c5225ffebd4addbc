"""report/index.html and its figures, rendered from metrics that carry every section of the report
contract (attribution, routing split and forensics, worst tokens, breakdowns) and from metrics that
carry none of them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html import unescape

import numpy as np
import pytest
from report_sections import HOSTILE_TOKEN, render_with_sections, worst_tokens

from mismatch_probe.report.accumulators.probability import CURVE_T
from mismatch_probe.report.build import build_report
from mismatch_probe.report.numbers import count, interval, value
from mismatch_probe.report.render.cards import WORST_SHOWN, worst_tokens_html
from mismatch_probe.report.render.plot_layout import MAX_SERIES, comparison_panels, series_style
from mismatch_probe.report.render.plots import write_plots
from mismatch_probe.report.render.plots_comparison import bin_labels
from mismatch_probe.report.render.tables import MAX_COLUMNS, flatten, manifest_table, metric_groups
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

SPEC = SyntheticSpec(
    n_samples=12,
    prompt_len=(4, 8),
    response_len=(10, 30),
    score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.2, route_fraction=0.05), ScoreSetSpec("r3", route_fraction=0.0)),
)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("html") / "run", SPEC)
    build_report(root)
    metrics = render_with_sections(root)
    return root / "report", metrics, (root / "report" / "index.html").read_text()


def test_sections_in_reading_order(rendered):
    _, metrics, html = rendered
    order = [
        html.index(mark)
        for mark in (
            '<section id="verdict">',
            '<section id="next">',
            '<section id="findings">',
            '<section id="comparisons">',
            '<section id="together">',
            '<section id="metrics">',
            '<section id="run">',
        )
    ]
    assert order == sorted(order)
    findings = html[order[2] : order[3]]
    items = [unescape(re.sub(r"<[^>]+>", "", li)) for li in re.findall(r"<li>(.*?)</li>", findings)]
    sentences = metrics["attribution"]["headlines"] + metrics["attribution"]["missing"]
    assert items == [s.replace("`", "") for s in sentences]  # word for word, in order
    assert "<code>probe rescore RUN --dtype fp32</code>" in findings and "&lt;&amp; not markup&gt;" in findings
    manifests = html[order[6] :]
    # the sides table, then the rollout's and each score set's manifest, each folded
    assert manifests.count("<details>") == 2 + len(SPEC.score_sets) and "<details open" not in manifests


def test_one_card_per_comparison_with_its_numbers(rendered):
    _, metrics, html = rendered
    cards = re.findall(r'<section class="card" id="comparison-(\d+)">(.*?)</section>', html, re.S)
    assert [int(i) for i, _ in cards] == list(range(len(metrics["comparisons"])))
    for (_, card), comp in zip(cards, metrics["comparisons"]):
        m = comp["metrics"]
        assert value(m["k3_kl"]) in card and interval(m["k3_kl_ci95"]) in card
        split = m["k3_kl@routing_diff"]
        assert (
            value(split) in card and f"routing differs in a layer ({count(m['n_tokens@routing_diff'])} tokens)" in card
        )
        text = card.split('<details class="figures">')[0]  # the SVGs carry their own CSS braces
        assert "engine synthetic · dtype bfloat16 · replay none" in text and "{" not in text
        assert f"compared</span> {count(m['n_tokens'])} tokens" in card
        # the comparison's own figures, inline and folded
        kinds = re.findall(r'<figure class="(\w+)"><svg', card)
        assert sorted(kinds) == ["breakdown", "forensics", "scatter"]
        assert "<img " not in card and '<details class="figures">' in card


def test_worst_tokens_are_escaped_and_highlighted(rendered):
    _, metrics, html = rendered
    assert html.count("<script>") == 1  # the sort script; the token's <script> is text
    assert "alert('x')</script>" not in html
    marks = [unescape(m) for m in re.findall(r"<mark>(.*?)</mark>", html, re.S)]
    entries = metrics["comparisons"][0]["worst_tokens"]
    assert marks[0] == HOSTILE_TOKEN and marks[1] == "\\n"  # a bare newline token is made visible
    first = html[html.index('id="comparison-0"') : html.index('id="comparison-1"')]
    shown, folded = first.split("<details>")[0], first.split("<details>")[1]
    assert shown.count("<mark>") == WORST_SHOWN and folded.count("<mark>") == len(entries) - WORST_SHOWN
    assert "<td>" + "<code>&lt;b&gt;&amp;lt;</code> / <code>R&amp;D</code>" + "</td>" in first
    second = shown.split("</tr>")[2]  # after the header row and the first entry
    context = re.search(r'<td class="context">(.*?)</td>', second, re.S).group(1)
    assert unescape(re.sub(r"<[^>]+>", "", context)) == "Q: 2 & 3 < 5?A: <i>yes</i> A: <i>yes</i> \\n"


def test_real_report_renders_the_sections_its_pipeline_computes(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SPEC)
    report = build_report(root)
    html = (report.directory / "index.html").read_text()
    attribution = report.metrics["attribution"]
    assert attribution["headlines"] and attribution["missing"]
    findings = html[html.index('<section id="findings">') : html.index('<section class="card"')]
    for line in attribution["headlines"]:
        assert line.split(":")[0] in unescape(re.sub(r"<[^>]+>", "", findings))
    assert html.count('<section class="card"') == len(SPEC.score_sets) and "routing identical" in html
    assert html.count('class="worst"') >= len(SPEC.score_sets)
    assert not list((root / "report").glob("*.png"))  # every figure is inside index.html
    assert html.count('<figure class="scatter"><svg') == len(SPEC.score_sets)


def test_metrics_tables_have_comparisons_as_rows(rendered):
    _, metrics, html = rendered
    groups = metric_groups(metrics["comparisons"])
    keys = [k for _, ks in groups for k in ks]
    flat = {
        k for c in metrics["comparisons"] for k, v in c["metrics"].items() if v is not None and not k.endswith("_ci95")
    }
    assert sorted(keys) == sorted(flat)  # every key with a value, each once
    assert all(len(ks) <= MAX_COLUMNS for _, ks in groups)
    tables = re.findall(r'<table class="sortable metrics">(.*?)</table>', html, re.S)
    assert len(tables) == len(groups)
    for table in tables:
        assert len(re.findall(r"<tr>", table.split("<tbody>")[1])) == len(metrics["comparisons"])


def test_comparison_panels_hold_at_most_six_series():
    pairs = [("rollout", f"scores/s{i}") for i in range(9)] + [("scores/a", "scores/b"), ("scores/c", "scores/d")]
    panels = comparison_panels(pairs)
    assert [(p.title, len(p.series)) for p in panels] == [
        ("reference rollout (1 of 2)", 5),
        ("reference rollout (2 of 2)", 4),
        ("other comparisons", 2),
    ]
    assert sorted(i for p in panels for i, _ in p.series) == list(range(len(pairs)))
    assert panels[0].series[0] == (0, "scores/s0") and panels[2].series[0] == (9, "scores/a vs scores/b")
    many = comparison_panels([(f"r{i}", "c") for i in range(13)])  # no shared reference: pooled, then split
    assert [len(p.series) for p in many] == [5, 4, 4] and all(len(p.series) <= MAX_SERIES for p in many)
    styles = [series_style(i) for i in range(MAX_SERIES)]
    assert len({s["color"] for s in styles}) == len({str(s["linestyle"]) for s in styles}) == MAX_SERIES


def test_bin_labels():
    assert bin_labels([0, 1, 2, 4, 8], integer=True) == ["0", "1", "2–3", "4–7"]
    assert bin_labels([0, 1e-3, 0.5, 1], integer=False) == ["0–0.001", "0.001–0.5", "0.5–1"]
    assert bin_labels([0, 2, None], integer=True) == ["0–1", "≥ 2"]


def test_manifest_values_are_flattened_to_plain_text():
    rows = flatten({"engine": {"engine": "sglang", "server_args": {"tp_size": 8, "flags": ["a", "b"]}}, "dtype": None})
    assert rows == [
        ("engine.engine", "sglang"),
        ("engine.server_args.tp_size", "8"),
        ("engine.server_args.flags", "a, b"),
        ("dtype", "—"),
    ]
    html = manifest_table({"model": "<script>x</script>&co", "tags": ["<b>"]})
    assert "&lt;script&gt;x&lt;/script&gt;&amp;co" in html and "&lt;b&gt;" in html and "<script>" not in html


def test_figures_inline_for_every_section(rendered):
    report, metrics, html = rendered
    assert not list(report.glob("*.png")) and "<img " not in html  # the page needs no file beside it
    together = html[html.index('<section id="together">') : html.index('<section id="metrics">')]
    assert together.count("<svg") == 1 + 3  # F(t) of the one group, the three routing levels
    per_comparison = re.findall(r'<figure class="(breakdown|forensics|scatter)"><svg', html)
    assert len(per_comparison) == 3 * len(metrics["comparisons"])
    on_disk = json.loads((report / "metrics.json").read_text())["comparisons"][0]["worst_tokens"]
    assert on_disk != metrics["comparisons"][0]["worst_tokens"]  # the hand-made sections never reach the file


def test_worst_tokens_routing_column_only_with_routing():
    rng = np.random.default_rng(1)
    assert "layers routed differently" in worst_tokens_html(worst_tokens(3, rng, routed=True))
    dense = worst_tokens_html(worst_tokens(WORST_SHOWN, rng, routed=False))  # all shown: nothing folded
    assert (
        "layers routed differently" not in dense and dense.count("<mark>") == WORST_SHOWN and "<details>" not in dense
    )
    assert worst_tokens_html([]) == worst_tokens_html(None) == ""


def test_figures_without_a_positive_value_still_draw(tmp_path):
    """F = 0 everywhere, no routing difference, empty bins: each figure says so instead of failing."""
    curve = {"t": CURVE_T.tolist(), "fraction": [0.0] * len(CURVE_T)}
    empty = {"edges": [0, 1, 2], "n_tokens": [0, 0], "k3_kl": [None, None], "abs_logprob_diff_mean": [None, None]}
    forensics = {
        "first_diff_layer": [0, 0],
        "n_tokens_routed": 5,
        "n_tokens_differing": 0,
        "margin_flip": {"side": "candidate", "edges": [0, 1, 2], "slots": [0, 3], "flips": [0, 0]},
    }
    comparison = {
        "reference": "rollout",
        "candidate": "scores/s",
        "metrics": {"k3_kl": 0.0},
        "extreme_fraction_curve": curve,
        "breakdowns": {"by_response_position": empty, "by_ref_prob": empty},
        "routing_histograms": {
            "router": [7, 0, 0],
            "token": [7, 0, 0, 0, 0],
            "per_layer_router_diff_rate": [0.0, 0.0],
            "sequence": {"edges": [0.0, 0.5, 1.0], "counts": [2, 0]},
        },
        "routing_forensics": forensics,
    }
    plots = write_plots(
        tmp_path, [comparison, comparison | {"extreme_fraction_curve": {**curve, "fraction": [None] * len(CURVE_T)}}]
    )
    assert len(plots) == 2 * 2 + 1 + 3  # breakdowns and forensics per comparison, F(t), three routing levels
    for plot in plots:
        assert plot.svg.startswith("<svg") and plot.svg.rstrip().endswith("</svg>")


def test_coinciding_f_curves_are_named_and_groups_follow_replay(tmp_path):
    from mismatch_probe.report.verdict.summary import Group

    curve = {"t": list(CURVE_T), "fraction": [0.5 / (i + 1) for i in range(len(CURVE_T))]}
    other = {"t": list(CURVE_T), "fraction": [0.9 / (i + 1) for i in range(len(CURVE_T))]}
    comparisons = [
        {"reference": "rollout", "candidate": c, "metrics": {"k3_kl": k}, "extreme_fraction_curve": f}
        for c, k, f in (
            ("scores/hf-fp32", 1e-3, curve),
            ("scores/megatron-fp32", 1.1e-3, curve),
            ("scores/r3", 1e-4, other),
        )
    ]
    groups = [
        Group(title="no R3, fp32", members=[0, 1]),
        Group(title="R3 replay, hf training", members=[2], replayed=True),
    ]
    plots = [p for p in write_plots(tmp_path, comparisons, None, groups) if p.kind == "extreme_fraction"]
    assert [p.title for p in plots] == [
        "F(t), no R3, fp32 (reference rollout)",
        "F(t), R3 replay, hf training (reference rollout)",
    ]
    assert plots[0].note == "scores/megatron-fp32 coincides with scores/hf-fp32 (drawn wider beneath it)"
    assert "scores/megatron-fp32 (= scores/hf-fp32)" in plots[0].svg and plots[1].note == ""


def test_figures_are_drawn_in_fresh_processes(monkeypatch):
    """Never a fork of the report's threaded process (a --ray local report hung there), and never a worker
    that imports the caller's __main__ again (spawn and forkserver do; an unguarded script would re-run)."""
    import subprocess

    from mismatch_probe.report.render import drawing

    commands = []
    real = subprocess.Popen

    def spy(args, **kwargs):
        commands.append(args)
        return real(args, **kwargs)

    monkeypatch.setattr(drawing.subprocess, "Popen", spy)
    monkeypatch.setattr(drawing.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(drawing.os, "fork", lambda: pytest.fail("forked"))
    assert drawing.draw_all([(str.upper, "a"), (str.upper, "b"), (str.lower, "C")]) == ["A", "B", "c"]
    assert commands == [[sys.executable, "-m", "mismatch_probe.report.render.drawing"]] * 2


def test_a_failed_drawing_worker_is_drawn_here_with_its_error(monkeypatch):
    from mismatch_probe.report.render import drawing

    monkeypatch.setattr(drawing.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(drawing.sys, "executable", "/bin/false")  # every worker fails
    assert drawing.draw_all([(str.upper, "a"), (str.lower, "B")]) == ["A", "b"]
    with pytest.raises(ZeroDivisionError):
        drawing.draw_all([(divmod, 1, 0), (str.upper, "a")])


def test_a_report_from_a_script_without_a_main_guard(tmp_path):
    """A user's script that calls build_report at top level, figures drawn on several cores."""
    run = write_synthetic_run(tmp_path / "run", SyntheticSpec(n_samples=8))
    script = tmp_path / "unguarded.py"
    script.write_text(f"from mismatch_probe.report.build import build_report\nbuild_report({str(run)!r})\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (run / "report" / "index.html").read_text().count("<svg") >= 3
