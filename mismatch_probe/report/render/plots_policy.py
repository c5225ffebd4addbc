"""The policy staleness figure: stale k3 (k3 of s = ℓ_new − ℓ_old) against the policy step, one line per
replay (natural, R2, R3), each point with its 95% bootstrap interval as an error bar. Log y when the values
span a decade or more; a 0 (R2 at the rollout's own checkpoint) cannot sit on a log axis, so it is marked
by a triangle on the bottom edge. Drawn from metrics.json's policy comparisons only."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report.policy.table import staleness_rows
from mismatch_probe.report.render.plot_layout import MIN_FONT, compact_log_ticks, legend_beside, series_style, to_svg
from mismatch_probe.vocab import REPLAYS

STALE_SIZE = (5.6, 3.0)  # inches, as a timeline: two side by side at 1280 px
LABELS = {"none": "natural", "r2": "R2", "r3": "R3"}
KEY = "k3_kl"  # in a policy comparison, k3 of s


def stale_series(comparisons: list[dict]) -> list[tuple[str, list, list, list]]:
    """(label, steps, stale k3, [low, high] or None) per replay that has a numbered step, in none, r2, r3 order."""
    out = []
    rows = [r for r in staleness_rows(comparisons) if r.step is not None]
    for replay in REPLAYS:
        mine = [r for r in rows if r.replay == replay]
        if mine:
            out.append(
                (
                    LABELS[replay],
                    [r.step for r in mine],
                    [r.metrics.get(KEY) for r in mine],
                    [r.metrics.get(ci_key(KEY)) for r in mine],
                )
            )
    return out


def _arrays(steps, values, cis) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    ci = np.array([c if c else [np.nan, np.nan] for c in cis], dtype=float).reshape(-1, 2)
    return np.array(steps, dtype=float), y, ci


def spans_decades(series) -> bool:
    """Whether the positive values and interval ends span a factor of 10 or more."""
    every = np.concatenate([np.r_[y, ci.ravel()] for y, ci in (_arrays(*s[1:])[1:] for s in series)] or [[]])
    positive = every[np.isfinite(every) & (every > 0)]
    return positive.size > 1 and positive.max() >= 10 * positive.min()


def stale_k3_plot(series: list[tuple[str, list, list, list]]) -> str:
    width, height = STALE_SIZE
    fig = plt.figure(figsize=STALE_SIZE)
    ax = fig.add_axes((0.75 / width, 0.55 / height, 2.9 / width, (height - 1.0) / height))
    fig.text(0.1 / width, 1 - 0.1 / height, "stale k3 per policy step", ha="left", va="top", fontsize=MIN_FONT + 1)
    log = spans_decades(series)
    all_steps = sorted({s for _, steps, _, _ in series for s in steps})
    shift = 0.04 * ((all_steps[-1] - all_steps[0]) or 1)  # the replays side by side: error bars stay apart
    zeros = []
    for slot, (label, steps, values, cis) in enumerate(series):
        x, y, ci = _arrays(steps, values, cis)
        x = x + (slot - (len(series) - 1) / 2) * shift
        style = series_style(slot)
        shown = np.where(log & (y <= 0), np.nan, y)
        below, above = np.clip(shown - ci[:, 0], 0, None), np.clip(ci[:, 1] - shown, 0, None)
        ax.errorbar(
            x, shown, yerr=np.nan_to_num([below, above]), label=label, marker="o", ms=4, lw=1.5, capsize=3, **style
        )
        if log and (y <= 0).any():
            zeros.append((x[y <= 0], style["color"]))
    if log:
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        for x, color in zeros:
            ax.plot(x, np.full(len(x), low), "v", color=color, ms=7, clip_on=False)
        if zeros:
            ax.plot([], [], "v", color="#555", label="0 (bottom edge)")
        ax.set_ylim(low, high)
        compact_log_ticks(ax.yaxis, low, high)
    ax.set_xticks(all_steps)
    ax.set(xlabel="policy step", ylabel="stale k3 (k3 of ℓ_new − ℓ_old)")
    ax.grid(True, which="both", alpha=0.3)
    legend_beside(ax)
    return to_svg(fig)
