"""Decode against prefill by position: mean |Δ log-prob| at each absolute position for the rollout against the
engine's own prefill and against each training set, and the position from which decode leaves prefill (the
position_onset rule) as a dashed line. Drawn from metrics.json's `position_profile` entries only."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from mismatch_probe.report.render.plot_layout import MIN_FONT, legend_beside, series_style, to_svg
from mismatch_probe.vocab import POSITION_PROFILE as PROFILE

DECODE_SIZE = (5.6, 3.0)  # inches, as a timeline


def decode_series(comparisons: list[dict]) -> tuple[list[tuple[str, np.ndarray, np.ndarray]], int | None]:
    """(label, positions, mean |delta|) per comparison with a position profile, and the onset of decode against
    prefill (the first profiled comparison whose candidate is an engine-prefill set and that has a step)."""
    series, onset = [], None
    for c in comparisons:
        profile = c.get(PROFILE)
        if not profile:
            continue
        mean = np.array([np.nan if v is None else v for v in profile["mean_abs_delta"]], dtype=float)
        positions = np.arange(len(mean))
        series.append((f"vs {c['candidate'].removeprefix('scores/')}", positions, mean))  # the rollout's pairs
        if onset is None and profile.get("against_prefill") and profile.get("onset"):
            onset = profile["onset"]["onset_position"]
    return series, onset


def decode_position_plot(series: list[tuple[str, np.ndarray, np.ndarray]], onset: int | None) -> str:
    width, height = DECODE_SIZE
    fig = plt.figure(figsize=DECODE_SIZE)
    ax = fig.add_axes((0.75 / width, 0.55 / height, 2.9 / width, (height - 1.0) / height))
    title = "rollout against each side, mean |Δ log-prob|" + (
        f": decode leaves prefill at {onset}" if onset is not None else ""
    )
    fig.text(0.1 / width, 1 - 0.1 / height, title, ha="left", va="top", fontsize=MIN_FONT + 1)
    for slot, (label, x, y) in enumerate(series):
        ax.plot(x, np.where(y > 0, y, np.nan), label=label, lw=1.5, **series_style(slot))  # 0 has no log
    if onset is not None:
        ax.axvline(onset, color="#555", ls="--", lw=1, label=f"onset {onset}")
    if any((y > 0).any() for _, _, y in series):
        ax.set_yscale("log")
        ax.margins(y=0.1)
    ax.set(xlabel="absolute position (prompt + response)", ylabel="mean |Δ log-prob|")
    legend_beside(ax)
    return to_svg(fig)
