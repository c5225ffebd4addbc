"""The top of report/index.html: the setup problems `probe doctor` found, the summary table (one row per
distinct comparison, a word beside each k3) and what to do next. Every text is escaped."""

from __future__ import annotations

import re
from html import escape

from mismatch_probe.report.render.tables import breakable
from mismatch_probe.report.verdict.summary import HEADER


def setup_findings(metrics: dict) -> str:
    """The setup checks that failed (metrics.json `findings`), above the numbers they invalidate."""
    findings = metrics.get("findings") or []
    if not findings:
        return ""
    items = "".join(
        f"<li><strong>{escape(str(f.get('check', 'setup check')))}</strong>: {escape(str(f.get('found', '')))}"
        + (f" ({escape(str(f['cause']))})" if f.get("cause") else "")
        + "</li>"
        for f in findings
    )
    return f'<p>Setup problems found by <code>probe doctor</code>; fix them before trusting the numbers (the fixes are under What to do next):</p><ul class="setup">{items}</ul>'


def summary_table(table_rows) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
    body = []
    for row in table_rows:
        label, k3, f2, router, where = row.cells()
        value, _, interval = k3.partition(" [")
        k3_html = escape(value) + (f' <span class="ci-inline">[{escape(interval)}</span>' if interval else "")
        word = (
            "—"
            if row.placement is None
            else f'<span class="word {row.placement.word}">{row.placement.word}</span> {escape(row.placement.where)}'
        )
        names = "<br>".join(
            f'<a href="#comparison-{row.indices[0]}">{breakable(f"{r} vs {c}")}</a>' for r, c in row.names
        )
        body.append(
            f'<tr><td>{names}</td><td class="num">{k3_html}</td><td class="num">{escape(f2)}</td>'
            f'<td class="num">{escape(router)}</td><td>{word}</td></tr>'
        )
    return f'<div class="scroll"><table class="summary"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def actions_html(actions) -> str:
    if not actions:
        return ""
    names = {"probe": "probe", "verl": "verl", "slime": "slime", "nemo_rl": "NeMo-RL"}
    items = []
    for action in actions:
        how = "".join(
            f"<dt>{names.get(k, k)}</dt><dd><code>{escape(v)}</code></dd>" for k, v in action.how.items() if v
        )
        effect = re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(action.effect))  # quoted commands as code
        items.append(
            f'<li><strong>{escape(action.title)}</strong> <span class="why">— {escape(action.why)}</span>'
            + (f'<div class="effect">{effect}</div>' if effect else "")
            + (f"<dl>{how}</dl>" if how else "")
            + "</li>"
        )
    return f'<section id="next"><h2>What to do next</h2><ol class="actions">{"".join(items)}</ol></section>'
