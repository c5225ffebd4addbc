"""RUN/locate/index.html: one file, the per-layer plot split by operation as inline SVG (as the report draws
its figures), the table, the rule and the sentence."""

from __future__ import annotations

from html import escape
from pathlib import Path

import numpy as np

from mismatch_probe.jsonfile import write_text_atomic
from mismatch_probe.locate.ops import ATTENTION, BLOCK, FINAL_NORM, LOGITS, MLP, ROUTER
from mismatch_probe.locate.rule import FLOOR_FACTOR, MARGIN
from mismatch_probe.report import numbers
from mismatch_probe.report.render.page import STYLE
from mismatch_probe.rundir.layout import LOCATE, Run
from mismatch_probe.rundir.location import is_remote

SERIES = (ATTENTION, MLP, BLOCK)


def _figure(rows, floors: dict) -> str:
    from mismatch_probe.report.render.plot_layout import empty_note, legend_beside, panel_figure, series_style, to_svg

    layered = [row for row in rows if row.layer is not None]
    layers = sorted({row.layer for row in layered})
    ends = {row.op: row for row in rows if row.layer is None}
    x_end = {FINAL_NORM: len(layers), LOGITS: len(layers) + 1}
    fig, axes = panel_figure(3, "b against a, per layer and operation")
    for ax, measure, title in (
        (axes[0], "own", "own: b's operation on a's input (relative L2)"),
        (axes[1], "accumulated", "accumulated: b's tensor against a's (relative L2)"),
    ):
        drawn = False
        for index, op in enumerate(SERIES):
            points = [(row.layer, getattr(row, measure)) for row in layered if row.op == op]
            xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
            keep = ys > 0
            if keep.any():
                ax.plot(xs[keep], ys[keep], marker="o", label=op, **series_style(index))
                drawn = True
        for index, op in enumerate((FINAL_NORM, LOGITS)):
            value = getattr(ends[op], measure)
            if value > 0:
                ax.plot([x_end[op]], [value], marker="s^"[index], linestyle="none", color="#333", label=op)
                drawn = True
        if measure == "own":
            ax.axhline(floors[ATTENTION], color="#888", linestyle=":", label="float32 floor (attention)")
        ax.set_title(title)
        if drawn:
            ax.set_yscale("log")
        else:
            empty_note(ax, "every value is 0")
        ax.set_xticks(list(range(len(layers) + 2)), [str(i) for i in layers] + ["norm", "logits"])
        ax.set_xlabel("layer")
        legend_beside(ax)
    routers = [row for row in layered if row.op == ROUTER]
    ax = axes[2]
    if routers:
        for index, measure in enumerate(("own", "accumulated")):
            ax.plot(
                [r.layer for r in routers],
                [getattr(r, measure) for r in routers],
                marker="o",
                label=measure,
                **series_style(index),
            )
        ax.set_ylabel("share of tokens")
        legend_beside(ax)
    else:
        empty_note(ax, "a dense model: no routers")
    ax.set_title("routers: tokens whose chosen experts differ")
    ax.set_xticks(list(range(len(layers))), [str(i) for i in layers])
    ax.set_xlabel("layer")
    return to_svg(fig)


def _table(rows, located) -> str:
    def cell(row, which):
        return row.cell(which)

    marked = ' style="background:#fbd5d0"'
    body = "".join(
        f"<tr{marked if row is located else ''}><td class=num>{'' if row.layer is None else row.layer}</td>"
        f"<td>{row.op}</td><td class=num>{escape(cell(row, 'own'))}</td><td class=num>{escape(cell(row, 'accumulated'))}</td></tr>"
        for row in rows
    )
    return f"<table><tr><th>layer</th><th>op</th><th>own</th><th>accumulated</th></tr>{body}</table>"


def render(run: Run, result) -> str:
    verdict = result.verdict
    floors = ", ".join(f"{op} {numbers.value(v)}" for op, v in verdict.floors.items() if op != ROUTER)
    notes = "".join(f"<p class=note>{escape(note)}</p>" for note in result.sides.notes)
    choice = result.choice
    ranked = f" (worst by k3 against scores/{choice.ranked_by})" if choice.ranked_by else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>probe locate: {escape(run.root.name)}</title><style>{STYLE}</style></head><body>
<nav><a href="../report/index.html">the report</a></nav>
<h1>Where the mismatch starts: {escape(run.root.name)}</h1>
<p class="verdict">{escape(verdict.sentence)}</p>
<p>a = <code>{escape(result.sides.a.text())}</code>, b = <code>{escape(result.sides.b.text())}</code>; sequences
{escape(", ".join(map(str, choice.worst)) or "none")} worst{escape(ranked)} and {escape(", ".join(map(str, choice.sampled)) or "none")} sampled;
{result.tokens} response positions.</p>
{notes}
<p>own: b's operation applied to a's input, against a's output (an MoE mlp with a's routes replayed);
accumulated: b's tensor against a's, carrying everything from below. Relative L2 ‖b − a‖ / ‖a‖ over the response
positions; routers: the share of tokens whose chosen expert set differs. An operation stands out when its own
error is above the float32 floor ({FLOOR_FACTOR:g}·2⁻²⁴·√K: {escape(floors)}; a router: more than one flipped
token) and at least {MARGIN:g}× the next largest own error of its kind. Zeros are not drawn on the log axes.</p>
<figure>{_figure(result.rows, verdict.floors)}</figure>
<h2>Every operation</h2>
{_table(result.rows, verdict.located)}
</body></html>
"""


def write_page(run: Run, result) -> Path | None:
    """RUN/locate/index.html; None for a run at a URL (the page is written beside local runs only)."""
    if is_remote(run.root):
        return None
    directory = run.root / LOCATE
    directory.mkdir(exist_ok=True)
    path = directory / "index.html"
    write_text_atomic(path, render(run, result))
    return path
