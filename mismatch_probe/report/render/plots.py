"""Report figures, drawn from the accumulated histograms (never from per-token points).

Figures of every comparison together (F(t), routing histograms) are small multiples of at most
MAX_SERIES lines per axes; each comparison also gets its own figures (scatter, breakdowns, forensics)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from mismatch_probe.report.render.drawing import draw_all
from mismatch_probe.report.render.plot_layout import (
    MAX_SERIES,
    MIN_FONT,
    compact_log_ticks,
    comparison_panels,
    empty_note,
    legend_beside,
    panel_figure,
    series_style,
    t_ticks,
    to_svg,
)
from mismatch_probe.report.render.plots_comparison import breakdown_plot, forensics_plot, has_forensics, scatter_plot
from mismatch_probe.report.render.plots_decode import decode_position_plot, decode_series
from mismatch_probe.report.render.plots_policy import stale_k3_plot, stale_series
from mismatch_probe.report.render.plots_steps import step_multiples_plot, timeline_plot
from mismatch_probe.report.verdict.summary import Group
from mismatch_probe.rundir.layout import REPORT_FIGURES

ROUTING_LEVELS = (
    ("router", "differing experts per (token, layer)", "Router-level routing differences"),
    ("token", "differing experts per token (summed over layers)", "Token-level routing differences"),
    ("sequence", "mean differing experts per token in a sequence", "Sequence-level routing differences"),
)


@dataclass(frozen=True)
class Plot:
    title: str
    svg: str  # an inline <svg> element
    kind: str  # scatter, breakdown, forensics, extreme_fraction, routing, timeline, policy
    comparison: int | None = None  # index into metrics["comparisons"]; None for a figure of several
    note: str = ""  # a caption line, e.g. which curves coincide


def is_report_figure(name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in REPORT_FIGURES)


def _fraction_curve(curve: dict) -> tuple[np.ndarray, np.ndarray]:
    t = np.array(curve["t"], dtype=float)
    f = np.array([np.nan if v is None else v for v in curve["fraction"]], dtype=float)
    f[f <= 0] = np.nan  # zero cannot sit on a log axis; the line stops where F reaches 0
    return t, f


def same_curve(a: dict, b: dict) -> bool:
    """Two F(t) curves a reader could not tell apart on the plot (one would hide the other)."""
    (ta, fa), (tb, fb) = _fraction_curve(a), _fraction_curve(b)
    return ta.shape == tb.shape and np.allclose(ta, tb) and np.allclose(fa, fb, rtol=1e-3, atol=0, equal_nan=True)


def coinciding(curves: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """(earlier label, later label) for each curve that coincides with an earlier one."""
    return [
        (curves[j][0], curves[i][0])
        for i in range(len(curves))
        for j in range(i)
        if same_curve(curves[j][1], curves[i][1])
    ][: len(curves)]


def t_limit(curves: list[dict]) -> float:
    """t up to where the largest F > 0 ends (at least 2, at most 100): the curves fill the axes."""
    reached = [t[f > 0] for t, f in (_fraction_curve(curve) for curve in curves)]
    return float(min(100.0, max(2.0, 1.25 * max((r.max() for r in reached if r.size), default=2.0))))


FT_SIZE = (5.6, 3.0)  # inches: two F(t) figures side by side at 1280 px, one at 800 px


def _wrapped(label: str) -> str:
    """`A vs B` over two lines: a legend beside a small figure has room for about 28 characters a line."""
    return label.replace(" vs ", "\nvs ") if len(label) > 28 else label


def extreme_fraction_plot(title: str, curves: list[tuple[str, dict]], right: float) -> str:
    """F(t) = fraction of tokens with max(r, 1/r) > t, log-log (R3 paper fig. 2d), one line per comparison
    of the group, each with its own colour and dash; a curve equal to an earlier one says so in its label
    and is drawn wider beneath it, so both stay visible."""
    width, height = FT_SIZE
    fig = plt.figure(figsize=FT_SIZE)
    ax = fig.add_axes((0.7 / width, 0.55 / height, 2.7 / width, (height - 0.55 - 0.45) / height))
    fig.text(0.1 / width, 1 - 0.1 / height, title, ha="left", va="top", fontsize=MIN_FONT + 1)
    same = {later: earlier for earlier, later in coinciding(curves)}
    wide = set(same.values())
    drawn = False
    for slot, (label, curve) in enumerate(curves[:MAX_SERIES]):
        t, f = _fraction_curve(curve)
        shown = _wrapped(label if label not in same else f"{label} (= {same[label]})")
        if np.isfinite(f).any():
            single = np.isfinite(f).sum() == 1  # F > 0 at one t only: a line of one point would not show
            width = 3.5 if label in wide else 1.5
            ax.plot(t, f, label=shown, lw=width, marker="o" if single else None, ms=5, **series_style(slot))
            drawn = True
        else:
            ax.plot([], [], label=f"{shown} (F = 0)", lw=1.5, **series_style(slot))
    ax.set(xscale="log", yscale="log", xlim=(1, right), xlabel="t", ylabel="F(t)")
    t_ticks(ax.xaxis, right)
    compact_log_ticks(ax.yaxis, *ax.get_ylim())
    ax.grid(True, which="both", alpha=0.3)
    if not drawn:
        ax.set_ylim(1e-4, 1)
        empty_note(ax, "F(t) = 0 for every t >= 1")
    legend_beside(ax)
    return to_svg(fig)


def routing_plot(
    series: list[tuple[str, np.ndarray, np.ndarray]],
    xlabel: str,
    title: str,
    pairs: list[tuple[str, str]] | None = None,
) -> str:
    """One step series per comparison: fraction of items by number of differing experts, log y."""
    panels = comparison_panels(pairs) if pairs else comparison_panels([("", label) for label, _, _ in series])
    fig, axes = panel_figure(len(panels), title)
    low, high = min(s[1][0] for s in series), max(s[1][-1] for s in series)
    for ax, panel in zip(axes, panels):
        for slot, (index, label) in enumerate(panel.series):
            _, edges, counts = series[index]
            total = counts.sum()
            frac = counts / total if total else np.zeros(len(counts))
            ax.stairs(np.where(frac > 0, frac, np.nan), edges, label=label, lw=1.5, **series_style(slot))
        ax.set(yscale="log", xlim=(low, high), xlabel=xlabel, ylabel="fraction")
        if low == -0.5:  # counts of differing experts: whole numbers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(panel.title if pairs else "", loc="left")
        compact_log_ticks(ax.yaxis, *ax.get_ylim())
        ax.grid(True, which="both", alpha=0.3)
        legend_beside(ax)
    return to_svg(fig)


def _routing_series(histograms: dict, level: str) -> tuple[np.ndarray, np.ndarray]:
    if level == "sequence":
        return np.array(histograms["sequence"]["edges"]), np.array(histograms["sequence"]["counts"])
    counts = np.array(histograms[level])
    return np.arange(len(counts) + 1) - 0.5, counts


def _comparison_jobs(index: int, data: dict, scatter, replayed: bool) -> list[tuple[tuple, Plot]]:
    """Scatter, breakdowns and (without replay) routing forensics of one comparison."""
    label = f"{data['reference']} vs {data['candidate']}"
    jobs = []
    if scatter is not None:
        jobs.append(
            ((scatter_plot, scatter, label, data["metrics"].get("k3_kl")), ("scatter", f"p_ref vs p_cand: {label}"))
        )
    if data.get("breakdowns"):
        jobs.append(((breakdown_plot, data["breakdowns"], label), ("breakdown", f"Mismatch breakdowns: {label}")))
    if has_forensics(data) and not replayed:
        jobs.append(((forensics_plot, data, label), ("forensics", f"Routing forensics: {label}")))
    return [(job, Plot(title=title, svg="", kind=kind, comparison=index)) for job, (kind, title) in jobs]


def _timeline_jobs(comparison_json: list[dict], members: list[int], band) -> list[tuple[tuple, Plot]]:
    """The timeline and its small multiples for each distinct comparison of a run that records steps.
    band: (kind, low, high, acceptable) shaded behind k3."""
    jobs = []
    for i in members:
        data = comparison_json[i]
        if not data.get("steps") or band is None:
            continue
        label = f"{data['reference']} vs {data['candidate']}"
        jobs.append(
            (
                (timeline_plot, label, data["steps"], data.get("drift"), band),
                Plot(title=f"k3 per step: {label}", svg="", kind="timeline", note=label),
            )
        )
        jobs.append(
            (
                (step_multiples_plot, label, data["steps"], data.get("drift")),
                Plot(title=f"per step: {label}", svg="", kind="timeline", note=label),
            )
        )
    return jobs


def _policy_jobs(comparison_json: list[dict]) -> list[tuple[tuple, Plot]]:
    """Stale k3 against the policy step, when the run has policy comparisons with a step."""
    series = stale_series(comparison_json)
    if not series:
        return []
    return [((stale_k3_plot, series), Plot(title="stale k3 per policy step", svg="", kind="policy"))]


def _decode_jobs(comparison_json: list[dict]) -> list[tuple[tuple, Plot]]:
    """Mean |delta| by position, where the run has the engine's own prefill (decode against prefill)."""
    series, onset = decode_series(comparison_json)
    if not series:
        return []
    title = "decode against prefill by position"
    return [((decode_position_plot, series, onset), Plot(title=title, svg="", kind="decode"))]


def _label(comparison: dict, group_reference: str | None) -> str:
    return (
        comparison["candidate"]
        if comparison["reference"] == group_reference
        else (f"{comparison['reference']} vs {comparison['candidate']}")
    )


def write_plots(
    directory: Path, comparison_json: list[dict], scatters: list | None = None, groups=None, band=None
) -> list[Plot]:
    """Every figure of the report, as inline SVG. `scatters` holds each comparison's p_ref x p_cand counts
    (or None); `groups` the comparisons to draw together (default: each distinct comparison in one group).
    Figures an earlier report wrote beside index.html are removed: the page needs none."""
    for old in directory.glob("*.png"):  # an earlier report's figures; a png of the user's stays
        if is_report_figure(old.name):
            old.unlink()
    scatters = scatters if scatters is not None else [None] * len(comparison_json)
    if groups is None:
        groups = [Group(title="comparisons", members=list(range(len(comparison_json))))] if comparison_json else []
    members = [i for g in groups for i in g.members]
    replayed = {i for g in groups if g.replayed for i in g.members}
    labelled = _timeline_jobs(comparison_json, members, band) + _policy_jobs(comparison_json)
    labelled += _decode_jobs(comparison_json)
    labelled += [job for i in members for job in _comparison_jobs(i, comparison_json[i], scatters[i], i in replayed)]
    right = t_limit([comparison_json[i]["extreme_fraction_curve"] for i in members]) if members else 2.0
    for group in groups:
        for start in range(0, len(group.members), MAX_SERIES):
            chunk = group.members[start : start + MAX_SERIES]
            # one reference for the whole panel: the legend names candidates only; else both sides
            shared = {comparison_json[i]["reference"] for i in chunk}
            reference = shared.pop() if len(shared) == 1 else None
            curves = [
                (_label(comparison_json[i], reference), comparison_json[i]["extreme_fraction_curve"]) for i in chunk
            ]
            same = coinciding(curves)
            note = "; ".join(f"{b} coincides with {a} (drawn wider beneath it)" for a, b in same)
            title = f"F(t), {group.title}" + (f" (reference {reference})" if reference else "")
            job = (extreme_fraction_plot, title, curves, right)
            labelled.append((job, Plot(title=title, svg="", kind="extreme_fraction", note=note)))
    routed = [i for i in members if i not in replayed and comparison_json[i].get("routing_histograms")]
    if routed:
        pairs = [(comparison_json[i]["reference"], comparison_json[i]["candidate"]) for i in routed]
        for level, xlabel, title in ROUTING_LEVELS:
            series = [
                (f"{r} vs {c}", *_routing_series(comparison_json[i]["routing_histograms"], level))
                for i, (r, c) in zip(routed, pairs)
            ]
            job = (routing_plot, series, xlabel, title, pairs)
            labelled.append((job, Plot(title=title, svg="", kind="routing")))
    svgs = draw_all([job for job, _ in labelled])
    return [replace(plot, svg=svg) for (_, plot), svg in zip(labelled, svgs)]
