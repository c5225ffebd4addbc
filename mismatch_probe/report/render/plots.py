"""Report figures, drawn from the accumulated histograms (never from per-token points).

Figures of every comparison together (F(t), routing histograms) are small multiples of at most
MAX_SERIES lines per axes; each comparison also gets its own figures (scatter, breakdowns, forensics)."""

from __future__ import annotations

import multiprocessing
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from mismatch_probe.report.render.plot_layout import (
    compact_log_ticks,
    comparison_panels,
    empty_note,
    legend_beside,
    panel_figure,
    save,
    series_style,
)
from mismatch_probe.report.render.plots_comparison import breakdown_plot, forensics_plot, has_forensics, scatter_plot
from mismatch_probe.rundir.layout import REPORT_FIGURES

MAX_PLOT_WORKERS = 4
T_TICKS = np.array([1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100])
ROUTING_LEVELS = (
    ("router", "differing experts per (token, layer)", "Router-level routing differences"),
    ("token", "differing experts per token (summed over layers)", "Token-level routing differences"),
    ("sequence", "mean differing experts per token in a sequence", "Sequence-level routing differences"),
)


@dataclass(frozen=True)
class Plot:
    title: str
    filename: str
    comparison: int | None = None  # index into metrics["comparisons"]; None for a figure of all of them


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def is_report_figure(name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in REPORT_FIGURES)


def _fraction_curve(curve: dict) -> tuple[np.ndarray, np.ndarray]:
    t = np.array(curve["t"], dtype=float)
    f = np.array([np.nan if v is None else v for v in curve["fraction"]], dtype=float)
    f[f <= 0] = np.nan  # zero cannot sit on a log axis; the line stops where F reaches 0
    return t, f


def extreme_fraction_plot(
    path: Path, curves: list[tuple[str, dict]], pairs: list[tuple[str, str]] | None = None
) -> None:
    """F(t) = fraction of tokens with max(r, 1/r) > t, log-log (R3 paper fig. 2d), small multiples.
    `pairs` groups the curves by reference; without it each curve is its own series, in order."""
    panels = comparison_panels(pairs) if pairs else comparison_panels([("", label) for label, _ in curves])
    fig, axes = panel_figure(len(panels), "Extreme-token fraction F(t)")
    reached = [t[f > 0] for t, f in (_fraction_curve(curve) for _, curve in curves)]
    # t up to where the largest F > 0 ends (at least 2, at most 100): the curves fill the axes
    right = float(min(100.0, max(2.0, 1.25 * max((r.max() for r in reached if r.size), default=2.0))))
    for ax, panel in zip(axes, panels):
        drawn = False
        for slot, (index, label) in enumerate(panel.series):
            t, f = _fraction_curve(curves[index][1])
            if np.isfinite(f).any():
                ax.plot(t, f, label=label, lw=1.5, **series_style(slot))
                drawn = True
            else:
                ax.plot([], [], label=f"{label} (F = 0)", lw=1.5, **series_style(slot))
        ax.set(xscale="log", yscale="log", xlim=(1, right), xlabel="t", ylabel="F(t): share with max(r, 1/r) > t")
        ax.set_title(panel.title if pairs else "", fontsize=9, loc="left")
        _t_ticks(ax.xaxis, right)
        compact_log_ticks(ax.yaxis, *ax.get_ylim())
        ax.grid(True, which="both", alpha=0.3)
        if not drawn:
            ax.set_ylim(1e-4, 1)
            empty_note(ax, "F(t) = 0 for every t >= 1")
        legend_beside(ax)
    save(fig, path)


def _t_ticks(axis, right: float) -> None:
    """Labelled t values that fit the range: 1.1 and 1.25 only while the axis ends below 10."""
    ticks = T_TICKS[(T_TICKS <= right) & ((right < 10) | ~np.isin(T_TICKS, (1.1, 1.25)))]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_locator(NullLocator())


def routing_plot(
    path: Path,
    series: list[tuple[str, np.ndarray, np.ndarray]],
    xlabel: str,
    title: str,
    pairs: list[tuple[str, str]] | None = None,
) -> None:
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
        ax.set_title(panel.title if pairs else "", fontsize=9, loc="left")
        compact_log_ticks(ax.yaxis, *ax.get_ylim())
        ax.grid(True, which="both", alpha=0.3)
        legend_beside(ax)
    save(fig, path)


def _routing_series(histograms: dict, level: str) -> tuple[np.ndarray, np.ndarray]:
    if level == "sequence":
        return np.array(histograms["sequence"]["edges"]), np.array(histograms["sequence"]["counts"])
    counts = np.array(histograms[level])
    return np.arange(len(counts) + 1) - 0.5, counts


def _comparison_jobs(directory: Path, index: int, data: dict, scatter) -> list[tuple[tuple, Plot]]:
    label = f"{data['reference']} vs {data['candidate']}"
    name = f"{slug(data['reference'])}__{slug(data['candidate'])}.png"
    jobs = []
    if scatter is not None:
        job = (scatter_plot, directory / f"scatter_{name}", scatter, label, data["metrics"].get("k3_kl"))
        jobs.append((job, Plot(title=f"p_ref vs p_cand: {label}", filename=f"scatter_{name}", comparison=index)))
    if data.get("breakdowns"):
        job = (breakdown_plot, directory / f"breakdown_{name}", data["breakdowns"], label)
        jobs.append(
            (
                job,
                Plot(
                    title=f"Mismatch by response position and by reference probability: {label}",
                    filename=f"breakdown_{name}",
                    comparison=index,
                ),
            )
        )
    if has_forensics(data):
        job = (forensics_plot, directory / f"forensics_{name}", data, label)
        jobs.append((job, Plot(title=f"Routing forensics: {label}", filename=f"forensics_{name}", comparison=index)))
    return jobs


def write_plots(directory: Path, comparison_json: list[dict], scatters: list | None = None) -> list[Plot]:
    """Every figure of the report; `scatters` holds each comparison's p_ref x p_cand counts (or None)."""
    for old in directory.glob("*.png"):  # an earlier report's figures; a png of the user's stays
        if is_report_figure(old.name):
            old.unlink()
    scatters = scatters if scatters is not None else [None] * len(comparison_json)
    pairs = [(d["reference"], d["candidate"]) for d in comparison_json]
    labelled = [
        job for i, (d, s) in enumerate(zip(comparison_json, scatters)) for job in _comparison_jobs(directory, i, d, s)
    ]
    if comparison_json:
        curves = [(f"{r} vs {c}", d["extreme_fraction_curve"]) for (r, c), d in zip(pairs, comparison_json)]
        job = (extreme_fraction_plot, directory / "extreme_fraction.png", curves, pairs)
        labelled.append((job, Plot(title="Extreme-token fraction F(t)", filename="extreme_fraction.png")))
    routed = [(pair, d["routing_histograms"]) for pair, d in zip(pairs, comparison_json) if d.get("routing_histograms")]
    if routed:
        routed_pairs = [pair for pair, _ in routed]
        for level, xlabel, title in ROUTING_LEVELS:
            series = [(f"{r} vs {c}", *_routing_series(h, level)) for (r, c), h in routed]
            job = (routing_plot, directory / f"routing_{level}.png", series, xlabel, title, routed_pairs)
            labelled.append((job, Plot(title=title, filename=f"routing_{level}.png")))
    unlisted = [plot.filename for _, plot in labelled if not is_report_figure(plot.filename)]
    if unlisted:  # the next report would take it for the user's and refuse to replace the folder
        raise RuntimeError(f"figure {unlisted[0]} is not in rundir.REPORT_FIGURES")
    _render([job for job, _ in labelled])
    return [plot for _, plot in labelled]


def _call(job) -> None:
    job[0](*job[1:])


def _render(jobs: list[tuple]) -> None:
    """Draw the figures on every core: matplotlib is single-threaded, and once the run has been read
    the report has nothing else to do. Forked workers inherit the imported matplotlib."""
    workers = min(len(jobs), os.cpu_count() or 1, MAX_PLOT_WORKERS)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        for job in jobs:
            _call(job)
        return
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_call, jobs, chunksize=1)
