"""The timeline of a run that records steps: k3 per step with its interval band, the published bands
shaded and the drift step marked; beside it, small multiples of F(2), mean |Δ| and the Pearson
correlation of the probabilities per step. Drawn from metrics.json's `steps` only."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.render.plot_layout import MIN_FONT, compact_log_ticks, to_svg

TIMELINE_SIZE = (5.6, 3.0)  # inches, as an F(t) figure: two side by side at 1280 px, stacked at 800 px
SMALL = (
    (EXTREME_FRACTION.at(2), "F(2)"),
    ("abs_logprob_diff_mean", "mean |Δ|"),
    ("prob_corr", "p Pearson"),
)


def _column(steps: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if s.get(key) is None else s[key] for s in steps], dtype=float)


def timeline_plot(label: str, steps: list[dict], drift: dict | None, band: tuple[str, float, float, float]) -> str:
    """band: (kind, low, high, acceptable): the published range of this kind of model, shaded."""
    kind, low, high, acceptable = band
    x = np.array([s["step"] for s in steps], dtype=float)
    k3 = _column(steps, "k3_kl")
    k3[k3 <= 0] = np.nan  # a log axis has no 0
    ci = np.array([s["k3_kl_ci95"] or [np.nan, np.nan] for s in steps], dtype=float)
    ci[ci <= 0] = np.nan
    width, height = TIMELINE_SIZE
    fig = plt.figure(figsize=TIMELINE_SIZE)
    ax = fig.add_axes((0.75 / width, 0.55 / height, (width - 1.0) / width, (height - 1.0) / height))
    fig.text(0.1 / width, 1 - 0.1 / height, f"k3 per step: {label}", ha="left", va="top", fontsize=MIN_FONT + 1)
    ax.axhspan(low, high, color="#f5d76e", alpha=0.25, lw=0, label=f"published {kind} band")
    ax.axhline(acceptable, color="#2e7d32", lw=1, ls=":", label="acceptable")
    ax.fill_between(x, ci[:, 0], ci[:, 1], color="#1f77b4", alpha=0.25, lw=0, step="mid", label="95% interval")
    ax.plot(x, k3, color="#1f77b4", lw=1.5, marker="o" if len(x) <= 40 else None, ms=3, label="k3")
    if drift:
        ax.axvline(drift["step"] - 0.5, color="#c62828", lw=1.5, ls="--", label=f"drift from step {drift['step']}")
    ax.set(yscale="log", xlabel="step", ylabel="k3 KL")
    finite = np.concatenate([k3[np.isfinite(k3)], ci[np.isfinite(ci)]])
    if finite.size:
        ax.set_ylim(finite.min() / 2, finite.max() * 2)
    compact_log_ticks(ax.yaxis, *ax.get_ylim())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=MIN_FONT, loc="best", framealpha=0.8)
    return to_svg(fig)


def step_multiples_plot(label: str, steps: list[dict], drift: dict | None) -> str:
    """F(2), mean |Δ| and Pearson per step, one small axes each, sharing the step axis."""
    x = np.array([s["step"] for s in steps], dtype=float)
    width, height = TIMELINE_SIZE
    fig, axes = plt.subplots(len(SMALL), 1, figsize=TIMELINE_SIZE, sharex=True)
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.2 / width, top=1 - 0.4 / height, bottom=0.5 / height)
    fig.text(0.1 / width, 1 - 0.1 / height, f"per step: {label}", ha="left", va="top", fontsize=MIN_FONT + 1)
    for ax, (key, name) in zip(axes, SMALL):
        ax.plot(x, _column(steps, key), color="#444444", lw=1.2)
        ax.set_ylabel(name, fontsize=MIN_FONT)
        ax.tick_params(labelsize=MIN_FONT)
        ax.grid(True, alpha=0.3)
        if drift:
            ax.axvline(drift["step"] - 0.5, color="#c62828", lw=1.2, ls="--")
    axes[-1].set_xlabel("step", fontsize=MIN_FONT)
    return to_svg(fig)
