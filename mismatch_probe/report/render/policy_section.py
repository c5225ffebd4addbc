"""The page's "Policy staleness" section, shown only when metrics.json has policy comparisons (a new
policy's pass against its θ_old set): the sentence on R2 against R3, one row per (step, replay) with its
intervals, and the stale k3 figure. The engine verdict above never counts these comparisons."""

from __future__ import annotations

from html import escape

from mismatch_probe.report.policy.table import COLUMNS, HEADER, staleness_rows
from mismatch_probe.report.policy.words import replay_bias_sentence
from mismatch_probe.report.render.tables import metric_cell

EXPLAINED = (
    "Per response token, with μ the rollout, old and new the training engine at θ_old and θ_new and N the "
    "natural (no replay) θ_new pass: a = ℓ_old − μ (training–inference, <em>tid</em>), s = ℓ_new − ℓ_old "
    "(staleness, <em>stale</em>), t = a + s (the whole IS log-ratio, <em>total</em>), b = ℓ_new − ℓ_new<sup>N</sup> "
    "(the bias a replay adds). Var t = Var a + Var s + 2 Cov. γ: RSPO's router-shift ratio. "
    "[low, high]: 95% bootstrap interval over sequences. These comparisons measure the policy's move, not "
    "engine mismatch: the verdict above leaves them out. See <code>docs/staleness.md</code>."
)


def _table(comparisons: list[dict]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
    body = "".join(
        f'<tr id="comparison-{row.index}"><td>{escape(row.step_text)}</td><td>{escape(row.replay)}</td>'
        + "".join(metric_cell(row.metrics, key) for _, key in COLUMNS)
        + "</tr>"
        for row in staleness_rows(comparisons)
    )
    return (
        f'<div class="scroll"><table class="staleness"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def policy_section(comparisons: list[dict], plots) -> str:
    sentence = replay_bias_sentence(comparisons)
    if sentence is None:
        return ""
    figures = "".join(f"<figure>{p.svg}</figure>" for p in plots if p.kind == "policy")
    return (
        '<section id="policy"><h2>Policy staleness</h2>'
        f'<p class="verdict-policy">{escape(sentence)}</p>'
        f"<p>{EXPLAINED}</p>"
        f"{_table(comparisons)}"
        + (
            f'<div class="together">{figures}</div><p>Stale k3 (k3 of s) per policy step, one line per replay, '
            "error bars the 95% intervals.</p>"
            if figures
            else ""
        )
        + "</section>"
    )
