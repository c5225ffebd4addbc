"""The `probe compare` page: one self-contained index.html (the figure is embedded) with the table of
chosen keys and F(t) small multiples, one axes per comparison and one line per run."""

from __future__ import annotations

import base64
import math
from html import escape

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mismatch_probe.compare.files import FIGURE  # noqa: E402
from mismatch_probe.jsonfile import write_text_atomic  # noqa: E402
from mismatch_probe.report.render.page import STYLE  # noqa: E402
from mismatch_probe.report.render.plot_layout import DPI, compact_log_ticks, t_ticks  # noqa: E402
from mismatch_probe.report.render.plots import t_limit  # noqa: E402
from mismatch_probe.rundir.manifests import now_iso  # noqa: E402

MAX_LINES = 6  # runs per axes; more runs get further axes for the same comparison
COLUMNS = 3
LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)))


def run_style(index: int) -> dict:
    """Colour and dash both change from run to run, so lines stay apart in grey print too."""
    return {"color": plt.get_cmap("tab10")(index % 10), "linestyle": LINE_STYLES[index % len(LINE_STYLES)]}


def _panels(result) -> list[tuple[str, tuple[str, str], list[int]]]:
    """(title, comparison, run indices) per axes: each comparison, split into groups of at most MAX_LINES runs."""
    panels = []
    for ref, cand in result.pairs:
        present = [i for i, run in enumerate(result.runs) if run.comparison((ref, cand)) is not None]
        groups = [present[k : k + MAX_LINES] for k in range(0, len(present), MAX_LINES)]
        for n, group in enumerate(groups):
            part = f" ({n + 1}/{len(groups)})" if len(groups) > 1 else ""
            panels.append((f"{ref} vs {cand}{part}", (ref, cand), group))
    return panels


def _draw_panel(ax, result, title: str, pair: tuple[str, str], group: list[int], right: float) -> None:
    drawn = False
    for i in group:
        curve = result.runs[i].comparison(pair).get("extreme_fraction_curve") or {}
        t = np.array(curve.get("t", []), dtype=float)
        f = np.array([np.nan if v is None else v for v in curve.get("fraction", [])], dtype=float)
        f[f <= 0] = np.nan  # F = 0 cannot sit on a log axis: the line stops there
        if t.size and t.size == f.size and np.isfinite(f).any():
            single = np.isfinite(f).sum() == 1  # a one-point line would not show
            ax.plot(t, f, lw=1.4, marker="o" if single else None, markersize=4, **run_style(i))
            drawn = True
    ax.set(xscale="log", yscale="log", xlim=(1, right), xlabel="t", ylabel="F(t)")
    t_ticks(ax.xaxis, right)  # each t labelled once, 1-2-5 steps or decades on y: no label repeated
    compact_log_ticks(ax.yaxis, *ax.get_ylim())
    if not drawn:
        ax.text(0.5, 0.5, "F(t) = 0 for every t >= 1", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=8)


def draw_overlays(result, path) -> None:
    panels = _panels(result)
    rows = max(1, math.ceil(len(panels) / COLUMNS))
    cols = min(COLUMNS, max(1, len(panels)))
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.2 * rows), squeeze=False)
    curves = [
        c["extreme_fraction_curve"]
        for run in result.runs
        for c in run.metrics["comparisons"]
        if c.get("extreme_fraction_curve", {}).get("t")
    ]
    right = t_limit(curves) if curves else 100.0
    for ax, (title, pair, group) in zip(axes.flat, panels):
        _draw_panel(ax, result, title, pair, group, right)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], lw=1.6, **run_style(i)) for i in range(len(result.runs))]
    # One legend for every panel, outside the axes: runs keep their style in every panel.
    fig.legend(
        handles,
        [run.label for run in result.runs],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(len(result.runs), 4),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle("Extreme-token fraction F(t) = fraction with max(r, 1/r) > t, per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


MARKS = {"above": "▲ above", "below": "▼ below"}


def _two_lines(text: str, separation: str = "", first: str = "") -> str:
    """`value [low, high]` with the interval on its own line, so several keys fit the page's width; then
    a mark, in words, where the interval lies entirely above or below the first run's."""
    value, bracket, rest = text.partition(" [")
    html = escape(value) + (f'<br><span class="ci">[{escape(rest)}</span>' if bracket else "")
    if separation:
        html += f'<br><strong class="separates {separation}">{MARKS[separation]} {escape(first)}</strong>'
    return html


def _table(result) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in ("comparison", "run", *result.keys))
    rows = []
    for pair in result.pairs:
        for run in result.runs:
            cells = "".join(
                f'<td class="num">'
                f"{_two_lines(result.cell(run, pair, key), result.separation(run, pair, key), result.runs[0].label)}</td>"
                for key in result.keys
            )
            rows.append(f"<tr><td>{escape(pair[0])} vs {escape(pair[1])}</td><td>{escape(run.label)}</td>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def write_page(result) -> None:
    figure = result.out / FIGURE
    draw_overlays(result, figure)
    image = base64.b64encode(figure.read_bytes()).decode("ascii")
    runs = "".join(f"<li>{escape(run.label)}: {escape(str(run.root))}</li>" for run in result.runs)
    html = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mismatch: {escape(", ".join(r.label for r in result.runs))}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{STYLE}
.separates.above {{ color: #7f1d1d; }} .separates.below {{ color: #14532d; }}</style></head><body>
<h1>Training-inference mismatch, run against run</h1>
<p>Generated {escape(now_iso())} from each run's report/metrics.json. A comparison a run lacks shows —.</p>
<h2>Runs</h2>
<ul>{runs}</ul>
<h2>Metrics</h2>
<div style="overflow-x: auto">{_table(result)}</div>
<p>[low, high]: 95% bootstrap interval over sequences. ▲ above / ▼ below: the run's interval lies entirely above
or below the first run's ({escape(result.runs[0].label)}): the two differ beyond resampling noise.</p>
<h2>F(t) per comparison</h2>
<figure><img src="data:image/png;base64,{image}" alt="F(t) per comparison, one line per run">
<figcaption>One panel per comparison, one line per run (at most {MAX_LINES} per panel).</figcaption></figure>
</body></html>
"""
    path = result.out / "index.html"
    write_text_atomic(path, html)
