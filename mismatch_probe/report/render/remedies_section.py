"""The page's "Measured remedies" section, only for a run with RUN/sweep.json (metrics.json `remedies`): one
row per sweep variant, its k3 against its own rollout and its ratio to the base with the 95% interval; how the
intervals and speeds are measured is folded, so the section costs a table's height."""

from __future__ import annotations

from html import escape

from mismatch_probe.report.verdict.best_remedy import best_remedy
from mismatch_probe.report.verdict.remedy_words import HEADER, REMEDIES_KEY, base_line, cells

EXPLAINED = (
    "Each variant changed one knob of the sweep's base (<code>probe sweep</code>); k3 is against the variant's "
    "own rollout, the ratio is that k3 over the base's. A training variant scores RUN's own tokens: its interval "
    "is a paired bootstrap over sequences (one weight per sequence in both). A rollout or both variant is a "
    "sibling run with tokens of its own: each run's sequences are resampled independently. Significant: the "
    "interval excludes 1; the best remedy is a variant whose interval lies entirely below 1. Speed: the variant's tokens per second over the base's, from the manifests (score sets "
    "for training; generation for rollout; both stages one after the other, 1/(1/generate + 1/score), for both). "
    "See <code>docs/remedies.md</code>."
)


def _row(entry: dict) -> str:
    """Numbers right-aligned; a variant not measured shows its note, left-aligned, where its k3 would be."""
    numeric = {4, 6, 7} | ({3} if entry.get("k3_kl") is not None else set())
    return "".join(f"<td{' class=num' if i in numeric else ''}>{escape(c)}</td>" for i, c in enumerate(cells(entry)))


def remedies_section(metrics: dict) -> str:
    entries = metrics.get(REMEDIES_KEY)
    if not entries:
        return ""
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
    body = "".join(f"<tr>{_row(e)}</tr>" for e in entries)
    return (
        '<section id="remedies"><h2>Measured remedies</h2>'
        f'<p class="best-remedy">Best remedy: {escape(best_remedy(metrics))}</p>'
        f'<div class="scroll"><table class="remedies"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        f"<details><summary>How these are measured ({escape(base_line(entries))})</summary><p>{EXPLAINED}</p></details>"
        "</section>"
    )
