"""The policy staleness section of the report: the R2-against-R3 sentence (known inputs), the staleness table's
rows and order, the stale k3 figure, the page and terminal of a real tiny policy run, and the verdict, the
summary table and the attribution leaving policy comparisons out."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from conftest import DEMO_MOE, DEMO_PROMPTS
from policy_runs import make_policy_run, router_perturbed
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.build import build_report
from mismatch_probe.report.policy.table import TWO_COV, staleness_rows
from mismatch_probe.report.policy.words import replay_bias_sentence, steps_phrase
from mismatch_probe.report.render.plots import Plot
from mismatch_probe.report.render.plots_policy import spans_decades, stale_k3_plot, stale_series
from mismatch_probe.report.render.policy_section import policy_section
from mismatch_probe.report.verdict.attribution import attribute
from mismatch_probe.report.verdict.bands import PUBLISHED
from mismatch_probe.report.verdict.summary import evidence_groups, rows, verdict
from mismatch_probe.rundir.layout import INFERENCE, TRAINING, SideInfo
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run


def policy(step, replay, bias=None, ci=None, **metrics) -> dict:
    """A policy comparison as metrics.json writes it, with the keys a test sets."""
    if bias is not None:
        metrics |= {"replay_bias_k3_kl": bias, "replay_bias_k3_kl_ci95": ci}
    return {
        "reference": "scores/old",
        "candidate": f"scores/new-{replay}-step{step}",
        "kind": "policy",
        "replay": replay,
        "policy_step": step,
        "natural": f"scores/new-step{step}",
        "metrics": {"n_tokens": 100, "k3_kl": 1e-3} | metrics,
    }


def engine(candidate: str, k3: float) -> dict:
    return {"reference": "rollout", "candidate": candidate, "metrics": {"n_tokens": 100, "k3_kl": k3}}


# --- the sentence ---------------------------------------------------------------------------------------------

MIXED = [
    policy(0, "r2", 0.0, [0.0, 0.0]),
    policy(0, "r3", 2e-3, [1e-3, 3e-3]),  # apart from R2's
    policy(1, "r2", 1e-3, [5e-4, 1.5e-3]),
    policy(1, "r3", 4e-3, [2e-3, 6e-3]),  # apart
    policy(4, "r2", 5e-3, [3e-3, 7e-3]),
    policy(4, "r3", 4e-3, [2e-3, 6e-3]),  # R3 lower, overlapping
    policy(8, "r2", 9e-3, [8e-3, 1e-2]),
    policy(8, "r3", 5e-3, [4e-3, 6e-3]),  # R3 lower, apart
    policy(8, "none", 0.0, [0.0, 0.0]),  # the natural pass: no part of the comparison
]


def test_sentence_names_the_lower_replay_per_step_and_how_sure():
    assert replay_bias_sentence(MIXED) == (
        "R2 adds less replay bias than R3 at steps 0, 1 (significantly: the 95% intervals are apart); "
        "R3 adds less replay bias than R2 at steps 4, 8 (significantly at step 8, not significantly at step 4)."
    )


def test_sentence_follows_the_numbers_not_the_order():
    """Swapping R2's and R3's numbers swaps the words; the input order does not matter."""
    swapped = [policy(c["policy_step"], {"r2": "r3", "r3": "r2"}.get(c["replay"], c["replay"])) for c in MIXED]
    for mine, theirs in zip(swapped, MIXED):
        mine["metrics"] = theirs["metrics"]
    assert replay_bias_sentence(list(reversed(swapped))) == (
        "R2 adds less replay bias than R3 at steps 4, 8 (significantly at step 8, not significantly at step 4); "
        "R3 adds less replay bias than R2 at steps 0, 1 (significantly: the 95% intervals are apart)."
    )


def test_overlapping_or_absent_intervals_are_not_significant():
    overlap = [policy(2, "r2", 1e-3, [5e-4, 2e-3]), policy(2, "r3", 3e-3, [1.9e-3, 4e-3])]
    assert replay_bias_sentence(overlap) == (
        "R2 adds less replay bias than R3 at step 2 (not significantly: the 95% intervals overlap)."
    )
    apart = [policy(2, "r2", 1e-3, [5e-4, 1.8e-3]), policy(2, "r3", 3e-3, [1.9e-3, 4e-3])]
    assert "(significantly: the 95% intervals are apart)" in replay_bias_sentence(apart)
    no_interval = [policy(2, "r2", 1e-3, None), policy(2, "r3", 3e-3, [1.9e-3, 4e-3])]
    assert "not significantly" in replay_bias_sentence(no_interval)


def test_missing_replays_and_steps_are_said():
    lone = [
        policy(0, "r2", 0.0, [0.0, 0.0]),
        policy(1, "r2", 1e-3, [5e-4, 2e-3]),
        policy(1, "r3", 1e-3, [5e-4, 2e-3]),
        policy(2, "r3", 1e-3, [5e-4, 2e-3]),
        policy(4, "r2", None),  # no bias measured: as if absent
        policy(4, "r3", 1e-3, [5e-4, 2e-3]),
    ]
    assert replay_bias_sentence(lone) == (
        "R2 and R3 add the same replay bias at step 1; only R2 was scored at step 0 (no R3 to compare); "
        "only R3 was scored at steps 2, 4 (no R2 to compare)."
    )
    assert replay_bias_sentence([policy(1, "none", 0.0, [0.0, 0.0])]) == (
        "No R2 or R3 pass has a replay bias: nothing to compare the replays by."
    )
    assert replay_bias_sentence([engine("scores/hf-bf16", 1e-3)]) is None
    assert replay_bias_sentence([]) is None


def test_steps_phrase():
    assert steps_phrase([3]) == "step 3"
    assert steps_phrase([0, 1, 4]) == "steps 0, 1, 4"
    assert steps_phrase([None]) == "the unnumbered step"
    assert steps_phrase([2, None]) == "step 2 and the unnumbered step"


# --- the table, the figure and the section ----------------------------------------------------------------------


def test_staleness_rows_by_step_then_replay():
    comparisons = [
        engine("scores/hf-fp32", 1e-4),
        policy(4, "r3"),
        policy(None, "none"),
        policy(1, "r2", tid_stale_log_ratio_cov=-1e-4, tid_stale_log_ratio_cov_ci95=[-3e-4, 2e-4]),
        policy(4, "none"),
        policy(1, "none"),
        policy(4, "r2"),
    ]
    table = staleness_rows(comparisons)
    assert [(r.step, r.replay) for r in table] == [
        (1, "none"),
        (1, "r2"),
        (4, "none"),
        (4, "r2"),
        (4, "r3"),
        (None, "none"),
    ]
    assert [r.index for r in table] == [5, 3, 4, 6, 1, 2]
    assert table[1].metrics[TWO_COV] == -2e-4 and table[1].metrics[TWO_COV + "_ci95"] == [-6e-4, 4e-4]
    assert table[0].metrics[TWO_COV] is None and table[-1].step_text == "—"


def test_section_shows_sentence_table_rows_and_figure():
    comparisons = [engine("scores/hf-fp32", 1e-4), *MIXED]
    figure = Plot(title="stale k3 per policy step", svg="<svg>STALE</svg>", kind="policy")
    html = policy_section(comparisons, [figure, Plot(title="t", svg="<svg>OTHER</svg>", kind="timeline")])
    assert '<section id="policy"><h2>Policy staleness</h2>' in html
    assert "R2 adds less replay bias than R3 at steps 0, 1" in html
    cells = re.findall(r'<tr id="comparison-(\d+)"><td>([^<]*)</td><td>([^<]*)</td>', html)
    assert cells == [
        (str(i + 1), str(c["policy_step"]), c["replay"])
        for i, c in sorted(enumerate(MIXED), key=lambda ic: (ic[1]["policy_step"], ic[1]["replay"]))
    ]
    assert "<svg>STALE</svg>" in html and "OTHER" not in html
    assert '2e-3<span class="ci">[1e-3, 3e-3]</span>' in html  # the page's number format, interval beneath
    assert policy_section([engine("scores/hf-fp32", 1e-4)], [figure]) == ""


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_stale_series_and_plot():
    comparisons = [
        policy(1, "r3", k3_kl=2e-3, k3_kl_ci95=[1e-3, 3e-3]),
        policy(0, "r2", k3_kl=0.0, k3_kl_ci95=[0.0, 0.0]),
        policy(1, "none", k3_kl=5e-2, k3_kl_ci95=[4e-2, 6e-2]),
        policy(None, "r2", k3_kl=1.0),  # no step: no place on the x axis
        policy(1, "r2", k3_kl=1e-3, k3_kl_ci95=None),
    ]
    series = stale_series(comparisons)
    assert series == [
        ("natural", [1], [5e-2], [[4e-2, 6e-2]]),
        ("R2", [0, 1], [0.0, 1e-3], [[0.0, 0.0], None]),
        ("R3", [1], [2e-3], [[1e-3, 3e-3]]),
    ]
    assert spans_decades(series)
    assert not spans_decades([("R2", [1, 2], [1e-3, 2e-3], [[9e-4, 1.1e-3], None])])
    svg = stale_k3_plot(series)
    assert svg.startswith("<svg") and all(f">{name}<" in svg for name in ("natural", "R2", "R3"))
    assert "0 (bottom edge)" in svg  # R2's 0 at step 0 is marked, not dropped
    assert stale_series([engine("scores/hf-fp32", 1e-4)]) == []


# --- the first screen leaves policy comparisons out ----------------------------------------------------------------


def test_summary_rows_and_verdict_leave_policy_comparisons_out():
    comparisons = [
        engine("scores/hf-fp32", 1e-4),
        policy(8, "none", k3_kl=0.5),  # a far larger k3: the policy's move, not engine mismatch
        engine("scores/hf-fp32-r3", 5e-5),
    ]
    metrics = {"comparisons": comparisons}
    table = rows(metrics, {}, PUBLISHED, True)
    assert [row.indices for row in table] == [[0], [2]]
    assert "new-none-step8" not in verdict(metrics, table) and "scores/hf-fp32" in verdict(metrics, table)
    assert sorted(i for group in evidence_groups(table, {}) for i in group.members) == [0, 2]


def test_attribution_leaves_policy_comparisons_out(tmp_path):
    """New-policy passes named to sort first would stand for the hf fp32 setup, and their natural and R2 passes
    against one θ_old set would read as a routing share of the engines' mismatch."""
    infos = {
        "rollout": SideInfo(side="rollout", role=INFERENCE, engine="hf", dtype="bf16"),
        "scores/hf-fp32": SideInfo(side="scores/hf-fp32", role=TRAINING, engine="hf", dtype="fp32"),
        "scores/a-step1": SideInfo(side="scores/a-step1", role=TRAINING, engine="hf", dtype="fp32"),
        "scores/a-r2-step1": SideInfo(side="scores/a-r2-step1", role=TRAINING, engine="hf", dtype="fp32", replay="r2"),
    }
    data = [
        engine("scores/hf-fp32", 1e-4),
        policy(1, "none", k3_kl=2e-3) | {"reference": "scores/hf-fp32", "candidate": "scores/a-step1"},
        policy(1, "r2", k3_kl=1e-3) | {"reference": "scores/hf-fp32", "candidate": "scores/a-r2-step1"},
    ]
    scanned = [
        SimpleNamespace(reference=d["reference"], candidate=d["candidate"], sequences=None, error_split=None)
        for d in data
    ]
    moe = SimpleNamespace(routing=SimpleNamespace(is_moe=True), model="demo")
    plain = SimpleNamespace(quantization=None, sampling=None)  # score sets neither quantized nor truncated
    run = SimpleNamespace(
        root=tmp_path, side_infos=lambda: infos, manifest=lambda: moe, score_manifest=lambda name: plain
    )
    attribution = attribute(run, scanned, data)
    assert attribution["routing_share"] == []
    said = " ".join(attribution["headlines"] + attribution["missing"])
    assert "a-step1" not in said and "a-r2-step1" not in said


# --- real runs ------------------------------------------------------------------------------------------------------


def test_page_without_policy_comparisons_has_no_section(tmp_path):
    spec = SyntheticSpec(n_samples=8, response_len=(4, 10), score_sets=(ScoreSetSpec("bf16"),))
    run = write_synthetic_run(tmp_path / "run", spec)
    report = build_report(run)
    page = report.index_path.read_text()
    assert 'id="policy"' not in page and "Policy staleness</h2>" not in page
    assert "stale k3 per policy step" not in page


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_page")
    new = router_perturbed(DEMO_MOE, root / "new", scale=0.1)
    run = make_policy_run(root, DEMO_MOE, DEMO_PROMPTS, new)
    return run, build_report(run)


@pytest.mark.slow
def test_page_of_a_policy_run(policy_run):
    run, report = policy_run
    comparisons = report.metrics["comparisons"]
    policies = [(i, c) for i, c in enumerate(comparisons) if c.get("kind") == "policy"]
    assert {(c["policy_step"], c["replay"]) for _, c in policies} == {(0, "r2"), (1, "none"), (1, "r2"), (1, "r3")}
    page = report.index_path.read_text()
    section = page[page.index('<section id="policy">') : page.index('<section id="comparisons">')]
    cells = re.findall(r'<tr id="comparison-(\d+)"><td>([^<]*)</td><td>([^<]*)</td>', section)
    assert cells == [
        (str(i), str(c["policy_step"]), c["replay"])
        for i, c in sorted(policies, key=lambda ic: (ic[1]["policy_step"], "none r2 r3".index(ic[1]["replay"])))
    ]
    assert "stale k3 per policy step" in section and section.count("<svg") == 1
    assert replay_bias_sentence(comparisons) in section.replace("&#x27;", "'")
    first_screen = page[: page.index("</section>")].replace("<wbr>", "")  # the verdict and the summary table
    assert all(c["candidate"] not in first_screen for _, c in policies)


@pytest.mark.slow
def test_terminal_summary_has_the_staleness_table_and_sentence(policy_run):
    run, report = policy_run
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"policy: {replay_bias_sentence(report.metrics['comparisons'])}" in lines
    assert any("policy staleness" in line for line in lines)
    table_rows = [line for line in lines if re.match(r"│ [01]\s+│ (none|r2|r3) ", line)]
    assert len(table_rows) == 4
    staleness = next(i for i, line in enumerate(lines) if "policy staleness" in line)
    policy_sides = {c["candidate"] for c in report.metrics["comparisons"] if c.get("kind") == "policy"}
    assert not any(side in line for side in policy_sides for line in lines[:staleness])  # verdict, summary
