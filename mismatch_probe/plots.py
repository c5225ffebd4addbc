"""Report figures, drawn from the accumulated histograms (never from per-token points)."""

from __future__ import annotations

import multiprocessing
import os
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402

DPI = 110
MAX_PLOT_WORKERS = 4


@dataclass(frozen=True)
class Plot:
    title: str
    filename: str


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _plain_log_labels(*axes) -> None:
    """Log-axis tick labels as plain text ("0.01", "1e-05"): matplotlib's default 10^x labels go
    through its mathtext parser, whose first use costs about a second of a report's run time."""
    for axis in axes:
        axis.set_major_formatter(LogFormatter())
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def scatter_plot(path: Path, counts: np.ndarray, label: str, k3) -> None:
    """p_ref vs p_cand as a 2-D histogram with log colour: tens of millions of tokens in one image."""
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    if counts.sum():
        image = ax.imshow(
            np.ma.masked_equal(counts.T, 0), origin="lower", extent=(0, 1, 0, 1), aspect="equal",
            norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)), cmap="viridis", interpolation="nearest",
        )  # fmt: skip
        _plain_log_labels(fig.colorbar(image, ax=ax, label="tokens per bin").ax.yaxis)
    else:
        ax.text(0.5, 0.5, "no tokens compared", ha="center", va="center", transform=ax.transAxes)
    ax.plot([0, 1], [0, 1], color="crimson", lw=0.8, ls="--", label="y = x")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="p reference", ylabel="p candidate")
    k3_text = "n/a" if k3 is None else f"{k3:.3g}"
    ax.set_title(f"{label}\nk3 KL = {k3_text}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    _save(fig, path)


def extreme_fraction_plot(path: Path, curves: list[tuple[str, dict]]) -> None:
    """F(t) = fraction of tokens with max(r, 1/r) > t, log-log (R3 paper fig. 2d)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn = False
    for label, curve in curves:
        t = np.array(curve["t"])
        f = np.array([np.nan if v is None else v for v in curve["fraction"]], dtype=float)
        f[f <= 0] = np.nan  # zero cannot sit on a log axis; the line stops where F reaches 0
        if np.isfinite(f).any():
            ax.plot(t, f, label=label, lw=1.4)
            drawn = True
    ax.set(xscale="log", yscale="log", xlim=(1, 100), xlabel="t", ylabel="F(t) = fraction with max(r, 1/r) > t")
    _plain_log_labels(ax.xaxis, ax.yaxis)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "F(t) = 0 for every t >= 1", ha="center", va="center", transform=ax.transAxes)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Extreme-token fraction", fontsize=10)
    _save(fig, path)


def routing_plot(path: Path, series: list[tuple[str, np.ndarray, np.ndarray]], xlabel: str, title: str) -> None:
    """One step series per comparison: fraction of items by number of differing experts, log y."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.set_xlim(min(edges[0] for _, edges, _ in series), max(edges[-1] for _, edges, _ in series))
    for label, edges, counts in series:
        total = counts.sum()
        if total:
            frac = counts / total
            ax.stairs(np.where(frac > 0, frac, np.nan), edges, label=label, lw=1.4)
    ax.set(yscale="log", xlabel=xlabel, ylabel="fraction", title=title)
    _plain_log_labels(ax.yaxis)
    if series:
        ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    _save(fig, path)


def write_plots(directory: Path, comparisons, comparison_json: list[dict]) -> list[Plot]:
    for old in directory.glob("*.png"):
        old.unlink()
    plots, jobs = [], []
    for comp, data in zip(comparisons, comparison_json):
        name = f"scatter_{slug(comp.reference)}__{slug(comp.candidate)}.png"
        jobs.append((scatter_plot, directory / name, comp.probability.scatter, comp.label, data["metrics"]["k3_kl"]))
        plots.append(Plot(f"p_ref vs p_cand: {comp.label}", name))
    curves = [(c.label, d["extreme_fraction_curve"]) for c, d in zip(comparisons, comparison_json)]
    jobs.append((extreme_fraction_plot, directory / "extreme_fraction.png", curves))
    plots.append(Plot("Extreme-token fraction F(t)", "extreme_fraction.png"))
    routed = [(c.label, d["routing_histograms"]) for c, d in zip(comparisons, comparison_json) if d["routing_histograms"]]
    if routed:
        levels = (
            ("router", "differing experts per (token, layer)", "Router-level routing differences"),
            ("token", "differing experts per token (summed over layers)", "Token-level routing differences"),
        )
        for key, xlabel, title in levels:
            series = [(label, np.arange(len(h[key]) + 1) - 0.5, np.array(h[key])) for label, h in routed]
            jobs.append((routing_plot, directory / f"routing_{key}.png", series, xlabel, title))
            plots.append(Plot(title, f"routing_{key}.png"))
        series = [(label, np.array(h["sequence"]["edges"]), np.array(h["sequence"]["counts"])) for label, h in routed]
        title = "Sequence-level routing differences"
        jobs.append((routing_plot, directory / "routing_sequence.png", series, "mean differing experts per token in a sequence", title))
        plots.append(Plot(title, "routing_sequence.png"))
    _render(jobs)
    return plots


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
