"""report/index.html: one self-contained file (figures are inline SVG) that opens alone, from disk, as a
CI artifact or a chat attachment.

In reading order: the verdict and the summary table (the first screen), what to do next, the measured
remedies (only with RUN/sweep.json), the findings,
policy staleness (only with policy comparisons, which the verdict leaves out), the evidence (one card per distinct comparison, grouped by replay then engine), the figures of the
comparisons together, the metrics tables (folded), then the sides and the manifests, folded, and how this was
measured (only for a run `probe diagnose` planned, folded)."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from mismatch_probe.jsonfile import write_text_atomic
from mismatch_probe.report import numbers
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.report.render.cards import comparison_card, side_facts
from mismatch_probe.report.render.first_screen import actions_html, setup_findings, summary_table
from mismatch_probe.report.render.measured_section import measured_section
from mismatch_probe.report.render.policy_section import policy_section
from mismatch_probe.report.render.remedies_section import remedies_section
from mismatch_probe.report.render.tables import SORT_SCRIPT, manifest_table, metrics_tables, table
from mismatch_probe.report.steps.words import drift_phrase, trend_phrase
from mismatch_probe.report.verdict.actions import next_actions
from mismatch_probe.report.verdict.bands import PUBLISHED, Bands
from mismatch_probe.report.verdict.production import productions, quantized_sides
from mismatch_probe.report.verdict.summary import evidence_groups, headline_row, one_side_quantized, rows, verdict
from mismatch_probe.rundir.layout import LOCATE, ROLLOUT, SCORES, Run
from mismatch_probe.rundir.location import is_remote
from mismatch_probe.rundir.manifests import RolloutManifest, now_iso

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1em auto; padding: 0 1em; max-width: 1180px; color: #222; line-height: 1.35; overflow-wrap: anywhere; }
h1 { font-size: 1.45em; margin: 0.3em 0; }
h2 { font-size: 1.2em; margin: 1.2em 0 0.4em; }
p.verdict { font-size: 1.15em; font-weight: 600; margin: 0.4em 0; }
table.summary { font-size: 0.9em; margin-top: 0.3em; }
table.summary td { vertical-align: middle; }
.word { display: inline-block; font-weight: 700; padding: 0 0.4em; border-radius: 3px; font-size: 0.9em; }
.word.ok { background: #d8f0dc; color: #14532d; }
.word.watch { background: #fff1c2; color: #6b4a00; }
.word.act { background: #fbd5d0; color: #7f1d1d; }
ol.actions li { margin: 0.3em 0 0.6em; }
ol.actions .why { color: #444; }
ol.actions dl { margin: 0.2em 0 0; display: grid; grid-template-columns: max-content 1fr; gap: 0.1em 0.8em; font-size: 0.9em; }
ol.actions dd { margin: 0; }
ol.actions .effect { font-size: 0.9em; color: #333; }
table.remedies { font-size: 0.85em; margin: 0.3em 0; }
ul.setup li { color: #7f1d1d; }
p.replayed { color: #14532d; font-style: italic; }
div.scroll { overflow-x: auto; }
.ci-inline { color: #666; white-space: nowrap; font-size: 0.9em; }
svg, img { max-width: 100%; height: auto; }
code { overflow-wrap: anywhere; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th { background: #f3f3f3; }
table.sortable th { cursor: pointer; }
table.sortable th::after { content: " ⇅"; color: #aaa; }
table.sortable th[aria-sort="ascending"]::after { content: " ▲"; color: #222; }
table.sortable th[aria-sort="descending"]::after { content: " ▼"; color: #222; }
table.metrics td.label { min-width: 14em; }
.ci { display: block; color: #666; font-size: 0.85em; }
.note { color: #8a5300; margin: 0.3em 0; }
nav { font-size: 0.9em; margin-bottom: 1em; }
ul.headlines li { margin: 0.35em 0; font-size: 1.05em; }
ul.missing li { color: #555; }
section.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.2em 1em 0.6em; margin: 0.8em 0; }
section.card h3 { margin: 0.4em 0; }
section.card p { margin: 0.3em 0; }
h3.group { margin: 1.2em 0 0.3em; }
section.card h3 .vs { color: #777; font-weight: normal; }
p.sides { color: #333; font-size: 0.92em; }
.role { display: inline-block; min-width: 5.5em; color: #777; }
.headline-numbers { display: flex; flex-wrap: wrap; gap: 0.5em; margin: 0.6em 0; }
.headline-numbers.split .num-box { min-width: 14em; }
.num-box { border: 1px solid #ddd; border-radius: 4px; padding: 0.2em 0.5em; flex: 1 1 8em; background: #fafafa; }
p.split .ci { display: inline; }
.num-box .what { font-size: 0.78em; color: #666; }
.num-box .value { font-size: 1.05em; font-variant-numeric: tabular-nums; }
table.worst td.context { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 0.9em; max-width: 44em; }
table.worst .prompt { color: #888; }
table.worst .prompt::after { content: " ‖ "; color: #999; }
mark { background: #ffd54f; }
table.worst th { white-space: nowrap; }
table.worst { margin: 0.2em 0; }
section.card h4 { margin: 0.5em 0 0.2em; }
section.card details { margin: 0.3em 0; }
section.card > details { display: inline-block; margin-right: 1.5em; vertical-align: top; }
section.card > details[open] { display: block; }
p.verdict-policy { font-weight: 600; }
table.staleness { font-size: 0.8em; }
table.staleness th, table.staleness td { padding: 0.2em 0.35em; overflow-wrap: normal; }
table.staleness td:nth-child(-n+2) { white-space: nowrap; }
table.staleness .ci { font-size: 0.8em; }
table.worst td, table.worst th { padding: 0.15em 0.4em; }
figure { display: inline-block; margin: 0.5em 0.5em 0.5em 0; vertical-align: top; max-width: 100%; }
figcaption.coincide { color: #8a5300; }
.figures { display: flex; flex-wrap: wrap; gap: 0.5em; align-items: flex-start; }
.figures figure { margin: 0; }
.together { display: flex; flex-wrap: wrap; gap: 0.5em 1em; }
figcaption { font-size: 0.85em; color: #555; }
details { margin: 0.5em 0; }
summary { cursor: pointer; font-weight: 600; }
div.manifests { display: flex; flex-wrap: wrap; gap: 0 1.5em; }
div.manifests details { margin: 0.2em 0; }
div.manifests details[open] { flex-basis: 100%; }
dl.glossary dt { font-weight: 600; }
dl.glossary dd { margin: 0 0 0.4em 1.5em; color: #444; }
"""

GLOSSARY = (
    ("k3 KL", "mean over response tokens of r − 1 − log r, r = p_cand / p_ref: 0 when the sides agree"),
    ("F(t), extreme_fraction@t", "share of tokens whose probability ratio max(r, 1/r) exceeds t"),
    ("argmax flip rate", "share of positions where the two sides' most likely token differs"),
    ("router / token diff rate", "share of (token, MoE layer) pairs / of tokens whose expert sets differ"),
    ("IS effective sample size", "(Σr)² / (n Σr²): 1 when every importance weight is equal"),
    ("[low, high]", "95% bootstrap interval over sequences"),
    (
        "‖ in a worst token's context",
        "the end of the prompt (grey) ‖ the response before the token; the token is highlighted",
    ),
)


def _attribution_item(entry) -> str:
    """A headline is a sentence, printed as written; `quoted` commands in it are set as code.
    An entry given as a dict shows its `text` (or `sentence`) field."""
    if isinstance(entry, dict):
        entry = entry.get("text") or entry.get("sentence") or ", ".join(f"{k}: {v}" for k, v in entry.items())
    return "<li>" + re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(str(entry))) + "</li>"


def _findings(metrics: dict) -> str:
    attribution = metrics.get("attribution") or {}
    headlines, missing = attribution.get("headlines") or [], attribution.get("missing") or []
    notes = sorted({note for c in metrics["comparisons"] for note in c.get("notes") or []})
    parts = []  # `probe doctor`'s findings open the page (first_screen.setup_findings), not repeated here
    if headlines:
        parts.append(f'<ul class="headlines">{"".join(_attribution_item(h) for h in headlines)}</ul>')
    if missing:
        parts.append(
            f'<h3>Not measured in this run</h3><ul class="missing">{"".join(_attribution_item(m) for m in missing)}</ul>'
        )
    if notes:
        parts.append(
            f'<h3>Notes</h3><ul class="notes">{"".join(f"<li class=note>{escape(n)}</li>" for n in notes)}</ul>'
        )
    if not parts:
        return ""
    return f'<section id="findings"><h2>Findings</h2>{"".join(parts)}</section>'


def _sides(run: Run, manifest: RolloutManifest) -> str:
    """Each side's engine and dtype, and its quantization and sampling (production.Production.setup_line)."""
    sides = [ROLLOUT, *(f"{SCORES}/{name}" for name in run.score_sets())]
    setups = productions(run, sides)
    return table(
        ["side", "produced by", "quantization; sampling"],
        [[side, side_facts(run, manifest, side, setup=False), setups[side].setup_line()] for side in sides],
    )


def _manifests(run: Run, manifest: RolloutManifest) -> str:
    folded = [("rollout manifest (manifest.json)", manifest.to_json())]
    folded += [(f"{SCORES}/{name} manifest", run.score_manifest(name).to_json()) for name in run.score_sets()]
    inner = "".join(
        f"<details><summary>{escape(title)}</summary>{manifest_table(obj)}</details>" for title, obj in folded
    )
    return f'<div class="manifests">{inner}</div>'  # folded side by side, an opened one on a line of its own


def decode_section(plots) -> str:
    """Decode against prefill by position, where the run has the inference engine's own prefill."""
    figures = "".join(f"<figure>{p.svg}</figure>" for p in plots if p.kind == "decode")
    if not figures:
        return ""
    return (
        '<section id="decode"><h2>Decode against prefill</h2>'
        "<p>Mean |Δ log-prob| by absolute position: the rollout (the engine's decode path) against the engine's "
        "own prefill of the same tokens, and against each training set. The dashed line marks where decode leaves "
        "prefill. Numbers: <code>decode_gap</code> and <code>decode_share</code> under attribution in "
        "metrics.json; <code>position_profile</code> in each comparison.</p>"
        f'<div class="together">{figures}</div></section>'
    )


def _timeline(plots, comparisons: list[dict]) -> str:
    """Mismatch over the run's steps, near the top: a timeline per comparison, its drift and trend named."""
    figures = [p for p in plots if p.kind == "timeline"]
    if not figures:
        return ""
    lines = []
    for comp in comparisons:
        if comp.get("steps") and not is_policy(comp):  # a policy comparison's timeline is not drawn
            said = [w for w in (drift_phrase(comp.get("drift")), trend_phrase(comp.get("trend"))) if w]
            text = "; ".join(said) or "no drift and no trend over the steps"
            lines.append(f"<li>{escape(comp['reference'])} vs {escape(comp['candidate'])}: {escape(text)}</li>")
    inner = "".join(f"<figure>{p.svg}</figure>" for p in figures)
    return (
        '<section id="steps"><h2>Over the run\'s steps</h2>'
        f"<ul>{''.join(lines)}</ul>"
        "<p>k3 per step with its 95% interval (sequences resampled within the step), the published band shaded; "
        "the dashed line marks where a drift begins. Per-step numbers: <code>steps</code> in metrics.json.</p>"
        f'<div class="together">{inner}</div></section>'
    )


def _together(plots, groups) -> str:
    ft = [p for p in plots if p.kind == "extreme_fraction"]
    routing = [p for p in plots if p.kind == "routing"]
    figures = "".join(
        f"<figure>{p.svg}"
        + (f'<figcaption class="coincide">{escape(p.note)}</figcaption>' if p.note else "")
        + "</figure>"
        for p in ft
    )
    html = (
        "<p>F(t): the share of tokens whose probability ratio max(r, 1/r) exceeds t, one panel per group "
        "(no R3, then R3 replay; then by engine), one colour and dash per comparison.</p>"
        f'<div class="together">{figures}</div>'
    )
    if routing:
        inner = "".join(f"<figure>{p.svg}</figure>" for p in routing)
        html += (
            f"<details><summary>Routing-difference histograms ({len(routing)} figures; comparisons without "
            f'replay)</summary><div class="together">{inner}</div></details>'
        )
    return f'<section id="together"><h2>All comparisons together</h2>{html}</section>'


def _locate_link(run: Run) -> str:
    """A link to `probe locate`'s page (RUN/locate/index.html) when the run has one."""
    if is_remote(run.root) or not (run.root / LOCATE / "index.html").is_file():
        return ""
    return '<p><a href="../locate/index.html">Where the mismatch starts: probe locate\'s page</a></p>'


def _band_words(bands: Bands, is_moe: bool, table_rows, quantized) -> str:
    """The bands the summary's words judge by: the model kind's, the quantized-rollout band where a comparison
    has exactly one side quantized (bands.py), or both."""
    judged = [one_side_quantized(*row.names[0], quantized) for row in table_rows]

    def band(quantized_band: bool) -> str:
        name, found = bands.kind(is_moe, quantized_band)
        return f"the {name} band ({escape(numbers.value(found.low))}..{escape(numbers.value(found.high))})"

    if not any(judged):
        return band(False)
    if all(judged):
        return band(True)
    return f"{band(False)}, or {band(True)} where one side is quantized"


def render_index(run: Run, manifest: RolloutManifest, metrics: dict, plots, bands: Bands = PUBLISHED) -> str:
    comparisons = metrics["comparisons"]
    infos = run.side_infos()
    is_moe = manifest.routing.is_moe
    quantized = quantized_sides(run)
    table_rows = rows(metrics, infos, bands, is_moe, quantized)
    groups = evidence_groups(table_rows, infos)
    by_index = {row.indices[0]: row for row in table_rows}
    findings = _findings(metrics)
    scope = comparisons[0]["routing_scope"] if comparisons else "all"
    routing = (
        (
            f"; routing metrics cover {'prompt and response' if scope == 'all' else 'response'} positions with "
            "routing on both sides"
        )
        if any(c.get("routing_histograms") for c in comparisons)
        else ""
    )
    cards = "\n".join(
        f'<h3 class="group">{escape(group.title)}</h3>'
        + "".join(comparison_card(by_index[i], comparisons, run, manifest, plots) for i in group.members)
        for group in groups
    )
    actions = next_actions(metrics, headline_row(table_rows), infos, run.root)
    glossary = "".join(f"<dt>{escape(term)}</dt><dd>{escape(text)}</dd>" for term, text in GLOSSARY)
    policies = sum(map(is_policy, comparisons))
    engine_count = f"{len(comparisons) - policies} comparisons ({len(table_rows)} distinct)" + (
        f"; the {policies} policy comparisons are under Policy staleness" if policies else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>mismatch report: {escape(run.root.name)}</title>
<style>{STYLE}</style></head><body>
<section id="verdict">
<h1>Training-inference mismatch: {escape(run.root.name)}</h1>
<p class="verdict">{escape(verdict(metrics, table_rows))}</p>
{_locate_link(run)}
{setup_findings(metrics)}
{summary_table(table_rows)}
<p class="legend">k3 KL: 0 when the sides agree; [low, high]: 95% bootstrap interval over sequences. Words: <span class="word ok">ok</span>
at this run's noise floor or at most {escape(numbers.value(bands.acceptable))} (acceptable, after NeMo-RL);
<span class="word watch">watch</span> inside {_band_words(bands, is_moe, table_rows, quantized)};
<span class="word act">act</span> above it. Bands and sources: the README, "Reading the report".</p>
</section>
{_timeline(plots, comparisons)}
{decode_section(plots)}
{actions_html(actions)}
{remedies_section(metrics)}
{findings}
{policy_section(comparisons, plots)}
<section id="comparisons"><h2>Evidence, one card per distinct comparison</h2>
<p>Generated {escape(now_iso())} from {engine_count}. Probability metrics
cover response tokens with finite log-probs on both sides{routing}.</p>
<details><summary>What the numbers mean</summary><dl class="glossary">{glossary}</dl></details>
{cards}
</section>
{_together(plots, groups)}
<section id="metrics"><h2>Metrics tables</h2>
<details><summary>Every key, one row per comparison (click a column header to sort)</summary>
<p>[low, high]: 95% bootstrap interval over sequences. Raw numbers, histograms and F(t) curves: metrics.json beside this page.</p>
<div class="scroll">{metrics_tables(comparisons)}</div>
</details>
</section>
<section id="run"><h2>Run and manifests</h2>
<details><summary>Sides: what produced each</summary><div class="scroll">{_sides(run, manifest)}</div></details>
{_manifests(run, manifest)}
</section>
{measured_section(run)}
{SORT_SCRIPT}
</body></html>
"""


def write_index(
    directory: Path, run: Run, manifest: RolloutManifest, metrics: dict, plots, bands: Bands = PUBLISHED
) -> Path:
    path = directory / "index.html"
    write_text_atomic(path, render_index(run, manifest, metrics, plots, bands))
    return path
