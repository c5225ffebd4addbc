"""The figures of one comparison: p_ref vs p_cand density, mismatch breakdowns, routing forensics."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from mismatch_probe.report.numbers import count, value
from mismatch_probe.report.render.plot_layout import (
    COLORS,
    FIGURE_WIDTH,
    MIN_FONT,
    compact_log_ticks,
    empty_note,
    plain_log_labels,
    to_svg,
)

BAR = COLORS[0]
COUNT_BAR = "#999999"


def scatter_plot(counts: np.ndarray, label: str, k3) -> str:
    """p_ref vs p_cand as a 2-D histogram with log colour: tens of millions of tokens in one image."""
    fig, ax = plt.subplots(figsize=(4.4, 4.0))
    if counts.sum():
        image = ax.imshow(
            np.ma.masked_equal(counts.T, 0),
            origin="lower",
            extent=(0, 1, 0, 1),
            aspect="equal",
            norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)),
            cmap="viridis",
            interpolation="nearest",
        )
        plain_log_labels(fig.colorbar(image, ax=ax, label="tokens per bin").ax.yaxis)
    else:
        empty_note(ax, "no tokens compared")
    ax.plot([0, 1], [0, 1], color="crimson", lw=0.8, ls="--")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="p reference", ylabel="p candidate")
    k3_text = "n/a" if k3 is None else value(k3)
    # the y = x line is named in the title: a legend box in a corner could hide off-diagonal tokens
    ax.set_title(f"k3 KL = {k3_text}; dashed: p cand = p ref", fontsize=MIN_FONT)
    return to_svg(fig, tight=True)


def _number(value) -> str:
    return f"{value:g}"


def bin_labels(edges: list, integer: bool) -> list[str]:
    """ "4–7" for the integer bin [4, 8), "0.1–0.25" for [0.1, 0.25); "≥ a" for an open last bin."""
    labels = []
    for low, high in zip(edges[:-1], edges[1:]):
        if high is None or not np.isfinite(high):
            labels.append(f"≥ {_number(low)}")
        elif integer:
            labels.append(_number(low) if high - low <= 1 else f"{_number(low)}–{_number(high - 1)}")
        else:
            labels.append(f"{_number(low)}–{_number(high)}")
    return labels


def _values(items: list) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in items], dtype=float)


def _categories(ax, labels: list[str]) -> np.ndarray:
    x = np.arange(len(labels))
    step = max(1, -(-len(labels) // 16))  # at most 16 tick labels: 48 layers would overlap
    rotate = len(labels[::step]) > 6
    ax.set_xticks(
        x[::step], labels[::step], rotation=40 if rotate else 0, ha="right" if rotate else "center", fontsize=MIN_FONT
    )
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    return x


def _bars(ax, labels: list[str], values: np.ndarray, color: str, ylabel: str) -> None:
    """Counts and rates: bars from zero on a linear axis, so their heights compare honestly."""
    x = _categories(ax, labels)
    ax.bar(x, np.nan_to_num(values, nan=0.0), color=color, width=0.8)
    if not np.isfinite(values).any():
        empty_note(ax, "no data")
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel, fontsize=MIN_FONT)


def _dots(ax, labels: list[str], values: np.ndarray, color: str, ylabel: str) -> None:
    """Values spanning decades: markers on a log axis (a bar on a log axis has no honest base).
    Bins with no value, a zero or an overflowed (infinite) value show no marker."""
    x = _categories(ax, labels)
    shown = np.where((values > 0) & np.isfinite(values), values, np.nan)  # an overflowed (inf) k3 has no place
    ax.plot(x, shown, color=color, marker="o", lw=1.0, ms=5)
    if np.isfinite(shown).any():
        ax.set_yscale("log")
        low, high = np.nanmin(shown), np.nanmax(shown)
        ax.set_ylim(low / 1.6, high * 1.6)
        compact_log_ticks(ax.yaxis, low / 1.6, high * 1.6)
    else:
        empty_note(ax, "no bin has a value above 0")
    ax.set_ylabel(ylabel, fontsize=MIN_FONT)


def breakdown_plot(breakdowns: dict, label: str) -> str:
    """k3 KL (top) and token count (bottom) per response-position bucket and per reference-probability bin."""
    parts = [
        (key, title, integer)
        for key, title, integer in (
            ("by_response_position", "response position (0 = first response token)", True),
            ("by_ref_prob", "reference probability p_ref", False),
        )
        if breakdowns.get(key)
    ]
    fig, axes = plt.subplots(2, len(parts), figsize=(FIGURE_WIDTH, 5.0), squeeze=False, sharex="col")
    fig.suptitle("Mismatch by response position and by reference probability", fontsize=10)
    for column, (key, title, integer) in enumerate(parts):
        data = breakdowns[key]
        labels = bin_labels(data["edges"], integer)
        _dots(axes[0, column], labels, _values(data["k3_kl"]), BAR, "k3 KL in the bin")
        _bars(axes[1, column], labels, _values(data["n_tokens"]), COUNT_BAR, "tokens in the bin")
        axes[1, column].set_xlabel(title, fontsize=MIN_FONT)
    # fixed margins (in inches for the rotated bin labels): tight_layout would draw the figure twice
    fig.subplots_adjust(left=0.8 / fig.get_figwidth(), right=0.98, top=0.92, bottom=1.1 / 5.0, wspace=0.4, hspace=0.12)
    return to_svg(fig)


def has_forensics(data: dict) -> bool:
    rates = (data.get("routing_histograms") or {}).get("per_layer_router_diff_rate") or []
    return any(r is not None for r in rates) or bool(data.get("routing_forensics"))


def _forensics_panels(data: dict) -> list[tuple]:
    """(draw, x labels, values, colour, y label, x label, title) for each forensics panel with data."""
    panels = []
    rates = (data.get("routing_histograms") or {}).get("per_layer_router_diff_rate") or []
    if any(r is not None for r in rates):
        labels = [str(i) for i in range(len(rates))]
        panels.append(
            (_bars, labels, _values(rates), BAR, "router-diff rate", "MoE layer", "Expert set differs, per layer")
        )
    forensics = data.get("routing_forensics") or {}
    first = forensics.get("first_diff_layer")
    if first:
        differing = forensics.get("n_tokens_differing") or 0
        share = _values(first) / differing if differing else _values(first) * np.nan
        title = (
            f"First differing layer\n({count(differing)} of {count(forensics.get('n_tokens_routed'))} tokens differ)"
        )
        panels.append(
            (
                _bars,
                [str(i) for i in range(len(first))],
                share,
                COLORS[1],
                "share of differing tokens",
                "MoE layer",
                title,
            )
        )
    flip = forensics.get("margin_flip")
    if flip:
        slots, flips = _values(flip["slots"]), _values(flip["flips"])
        rate = np.divide(flips, slots, out=np.full(len(slots), np.nan), where=slots > 0)
        labels = bin_labels(flip["edges"], integer=False)
        xlabel = f"router margin ({flip['side']} side): k-th minus (k+1)-th score"
        panels.append((_dots, labels, rate, COLORS[2], "flip rate", xlabel, "Routing flips vs router margin"))
    return panels


def forensics_plot(data: dict, label: str) -> str:
    """Per-layer router-diff rate, first differing layer, routing-flip rate against the router margin:
    two panels a row, so the figure keeps FIGURE_WIDTH."""
    panels = _forensics_panels(data)
    rows = -(-len(panels) // 2)
    height = 3.0 * rows + 0.4
    fig, axes = plt.subplots(rows, 2, figsize=(FIGURE_WIDTH, height), squeeze=False)
    fig.suptitle("Routing forensics", fontsize=10)
    for ax, (draw, labels, values, color, ylabel, xlabel, title) in zip(axes.flat, panels):
        draw(ax, labels, values, color, ylabel)
        ax.set_xlabel(xlabel, fontsize=MIN_FONT)
        ax.set_title(title, fontsize=MIN_FONT)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.subplots_adjust(
        left=0.8 / FIGURE_WIDTH, right=0.98, top=1 - 0.55 / height, bottom=1.0 / height, wspace=0.4, hspace=1.1
    )
    return to_svg(fig)
