"""report/index.html: one self-contained page (plots are sibling PNGs) that opens from disk.

In reading order: findings, one card per comparison, the figures of all comparisons together,
the metrics tables (comparisons as rows, sortable), then the sides and the manifests, folded."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

from mismatch_probe.report.render.cards import comparison_card, side_facts
from mismatch_probe.report.render.tables import SORT_SCRIPT, manifest_table, metrics_tables, table
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run
from mismatch_probe.rundir.manifests import RolloutManifest, now_iso

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1.5em; max-width: 1180px; color: #222; line-height: 1.4; }
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
section.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.4em 1.2em 1em; margin: 1.2em 0; }
section.card h3 .vs { color: #777; font-weight: normal; }
p.sides { color: #333; font-size: 0.92em; }
.role { display: inline-block; min-width: 5.5em; color: #777; }
.headline-numbers { display: flex; flex-wrap: wrap; gap: 0.5em; margin: 0.6em 0; }
.headline-numbers.split .num-box { min-width: 14em; }
.num-box { border: 1px solid #ddd; border-radius: 4px; padding: 0.3em 0.7em; min-width: 8.5em; background: #fafafa; }
.num-box .what { font-size: 0.78em; color: #666; }
.num-box .value { font-size: 1.05em; font-variant-numeric: tabular-nums; }
table.worst td.context { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 0.9em; max-width: 34em; }
table.worst .prompt { color: #888; }
table.worst .prompt::after { content: " ║ "; color: #bbb; }
mark { background: #ffd54f; }
figure { display: inline-block; margin: 0.5em 0.5em 0.5em 0; vertical-align: top; max-width: 100%; }
figure img { max-width: 100%; height: auto; }
.figures { display: flex; flex-wrap: wrap; gap: 0.5em; align-items: flex-start; }
.figures figure { margin: 0; }
.figures figure.scatter { flex: 0 0 30%; }
.figures figure.breakdown { flex: 1 1 60%; }
.figures figure.forensics { flex: 1 1 100%; }
figcaption { font-size: 0.85em; color: #555; }
details { margin: 0.5em 0; }
summary { cursor: pointer; font-weight: 600; }
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
)


def _attribution_item(entry) -> str:
    """A headline is a sentence, printed as written; `quoted` commands in it are set as code.
    An entry given as a dict shows its `text` (or `sentence`) field."""
    if isinstance(entry, dict):
        entry = entry.get("text") or entry.get("sentence") or ", ".join(f"{k}: {v}" for k, v in entry.items())
    return "<li>" + re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(str(entry))) + "</li>"


def _doctor(findings: list[dict]) -> str:
    """`probe doctor`'s findings first: each is a setup bug that makes the numbers below meaningless."""
    items = "".join(
        f'<li class="doctor"><b>{escape(f["check"])}</b>: {escape(f["found"])}<br>cause: {escape(f["cause"])}'
        f"<br>fix: {escape(f['fix'].get('probe') or '')}</li>"
        for f in findings
    )
    return f'<h3>Before you trust a number: probe doctor</h3><ul class="doctor">{items}</ul>'


def _findings(metrics: dict) -> str:
    attribution = metrics.get("attribution") or {}
    headlines, missing = attribution.get("headlines") or [], attribution.get("missing") or []
    notes = sorted({note for c in metrics["comparisons"] for note in c.get("notes") or []})
    parts = [_doctor(metrics.get("findings") or [])] if metrics.get("findings") else []
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
    sides = [ROLLOUT, *(f"{SCORES}/{name}" for name in run.score_sets())]
    return table(["side", "produced by"], [[side, side_facts(run, manifest, side)] for side in sides])


def _manifests(run: Run, manifest: RolloutManifest) -> str:
    folded = [("rollout manifest (manifest.json)", manifest.to_json())]
    folded += [(f"{SCORES}/{name} manifest", run.score_manifest(name).to_json()) for name in run.score_sets()]
    return "".join(
        f"<details><summary>{escape(title)}</summary>{manifest_table(obj)}</details>" for title, obj in folded
    )


def _nav(comparisons: list[dict], has_findings: bool) -> str:
    cards = " · ".join(
        f'<a href="#comparison-{i}">{escape(c["reference"])} vs {escape(c["candidate"])}</a>'
        for i, c in enumerate(comparisons)
    )
    findings = '<a href="#findings">Findings</a> · ' if has_findings else ""
    return (
        f'<nav>{findings}<a href="#comparisons">Comparisons</a> · <a href="#together">All comparisons together</a> · '
        f'<a href="#metrics">Metrics tables</a> · <a href="#run">Run and manifests</a><br>{cards}</nav>'
    )


def render_index(run: Run, manifest: RolloutManifest, metrics: dict, plots) -> str:
    comparisons = metrics["comparisons"]
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
    cards = "\n".join(comparison_card(i, c, run, manifest, plots) for i, c in enumerate(comparisons))
    together = "".join(
        f'<figure><img src="{escape(p.filename)}" alt="{escape(p.title)}"><figcaption>{escape(p.title)}</figcaption></figure>'
        for p in plots
        if p.comparison is None
    )
    glossary = "".join(f"<dt>{escape(term)}</dt><dd>{escape(text)}</dd>" for term, text in GLOSSARY)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mismatch report: {escape(run.root.name)}</title>
<style>{STYLE}</style></head><body>
<h1>Training-inference mismatch: {escape(run.root.name)}</h1>
<p>Generated {escape(now_iso())} from {len(comparisons)} comparisons. Probability metrics cover response tokens with
finite log-probs on both sides{routing}.</p>
{_nav(comparisons, bool(findings))}
{findings}
<section id="comparisons"><h2>Comparisons</h2>
<details><summary>What the numbers mean</summary><dl class="glossary">{glossary}</dl></details>
{cards}
</section>
<section id="together"><h2>All comparisons together</h2>{together}</section>
<section id="metrics"><h2>Metrics tables</h2>
<p>One row per comparison; click a column header to sort. [low, high]: 95% bootstrap interval over sequences.
Raw numbers, histograms and F(t) curves: <a href="metrics.json">metrics.json</a>.</p>
{metrics_tables(comparisons)}
</section>
<section id="run"><h2>Run and manifests</h2>
{_sides(run, manifest)}
{_manifests(run, manifest)}
</section>
{SORT_SCRIPT}
</body></html>
"""


def write_index(directory: Path, run: Run, manifest: RolloutManifest, metrics: dict, plots) -> Path:
    path = directory / "index.html"
    tmp = directory / ".index.html.tmp"
    tmp.write_text(render_index(run, manifest, metrics, plots))
    tmp.replace(path)
    return path
