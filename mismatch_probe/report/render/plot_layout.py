"""How report figures are laid out: at most MAX_SERIES lines per axes, each with its own colour AND
line style, legends beside the data rather than on it, and comparisons grouped into small multiples.

Figures go into the page as inline SVG with real text (svg.fonttype none): the page is one file, and
text stays sharp and searchable. A figure is at most FIGURE_WIDTH inches wide, so it is shown at its own
size down to an 800 px window, and its smallest text (MIN_FONT points) reads at 11 px or more."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams.update(
    {
        "svg.fonttype": "none",  # text as <text>, not paths: smaller, and the browser test can measure it
        "svg.hashsalt": "mismatch-probe",  # the same figure gives the same ids: pages differ only where data does
        "font.size": 9,
        "axes.titlesize": 9,
        "axes.labelsize": 9,
        "xtick.labelsize": 9,
        "ytick.labelsize": 9,
        "legend.fontsize": 9,
        "figure.titlesize": 10,
    }
)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    LogFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
)

DPI = 110
MAX_SERIES = 6
# Colour-blind-safe (Okabe-Ito) colours, each paired with its own dash pattern: two series never
# share both, and a greyscale print still tells them apart.
COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
DASHES = ("-", "--", "-.", ":", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 1)))
FIGURE_WIDTH = 7.0  # inches: 672 CSS px at the SVG's own size, which fits an 800 px window
MIN_FONT = 9  # points; 1 pt = 4/3 CSS px at the SVG's own size, so 12 px on the page
PANEL_SIZE = (3.6, 2.4)  # inches of one axes; the legend gets the rest of FIGURE_WIDTH to its right


def series_style(index: int) -> dict:
    return {"color": COLORS[index % len(COLORS)], "linestyle": DASHES[index % len(DASHES)]}


@dataclass
class Panel:
    """One axes of a small-multiples figure: its title and (series index, legend label) pairs."""

    title: str
    series: list[tuple[int, str]] = field(default_factory=list)


def _chunks(items: list, size: int) -> list[list]:
    """Split into the fewest chunks of at most `size`, as even as possible (13 -> 5 + 4 + 4)."""
    count = -(-len(items) // size)
    bounds = [-(-len(items) * i // count) for i in range(count + 1)] if count else []
    return [items[low:high] for low, high in zip(bounds[:-1], bounds[1:])]


def comparison_panels(pairs: list[tuple[str, str]]) -> list[Panel]:
    """Comparisons sharing a reference share axes (the legend then names only the candidate); the
    comparisons alone with their reference share an "other comparisons" axes with full labels."""
    by_reference: dict[str, list[int]] = {}
    for index, (reference, _) in enumerate(pairs):
        by_reference.setdefault(reference, []).append(index)
    panels, others = [], []
    for reference, indices in by_reference.items():
        if len(indices) == 1:
            others += indices
            continue
        chunks = _chunks(indices, MAX_SERIES)
        for number, chunk in enumerate(chunks, 1):
            part = f" ({number} of {len(chunks)})" if len(chunks) > 1 else ""
            panels.append(Panel(title=f"reference {reference}{part}", series=[(i, pairs[i][1]) for i in chunk]))
    chunks = _chunks(others, MAX_SERIES)
    for number, chunk in enumerate(chunks, 1):
        part = f" ({number} of {len(chunks)})" if len(chunks) > 1 else ""
        title = "other comparisons" if panels else "comparisons"
        panels.append(Panel(title=title + part, series=[(i, f"{pairs[i][0]} vs {pairs[i][1]}") for i in chunk]))
    return panels


def panel_figure(count: int, title: str):
    """A figure of `count` axes stacked vertically, room on the right of each for its legend."""
    width, height = FIGURE_WIDTH, PANEL_SIZE[1] * count + 0.5 * (count - 1) + 1.1
    fig, axes = plt.subplots(count, 1, figsize=(width, height), squeeze=False)
    fig.suptitle(title, fontsize=11)
    # Margins in inches: the y label on the left, the legends on the right, the title on top.
    fig.subplots_adjust(
        left=0.8 / width,
        right=(0.8 + PANEL_SIZE[0]) / width,
        top=1 - 0.7 / height,
        bottom=0.5 / height,
        hspace=0.75 * 0.4 / PANEL_SIZE[1] + 0.25,
    )
    return fig, list(axes[:, 0])


def legend_beside(ax) -> None:
    """The legend to the right of the axes, outside the data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=MIN_FONT, frameon=False, handlelength=3.2)


def plain_log_labels(*axes) -> None:
    """Log-axis tick labels as plain text ("0.01", "1e-05"): matplotlib's default 10^x labels go
    through its mathtext parser, whose first use costs about a second of a report's run time."""
    for axis in axes:
        axis.set_major_formatter(LogFormatter())
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def compact_log_ticks(axis, low: float, high: float) -> None:
    """Plain labels ("0.05", "2e-05") at 1-2-5 steps over narrow ranges, powers of ten over wide ones."""
    if not 0 < low < high:  # an axes with no positive data keeps matplotlib's defaults
        return
    decades = np.log10(high / low)
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


T_TICKS = np.array([1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100])


def t_ticks(axis, right: float) -> None:
    """Labelled t values of an F(t) axis that fit the range, each once: 1.1 and 1.25 only while the axis
    ends below 10."""
    ticks = T_TICKS[(T_TICKS <= right) & ((right < 10) | ~np.isin(T_TICKS, (1.1, 1.25)))]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_locator(NullLocator())


def empty_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555", fontsize=MIN_FONT)


def to_svg(fig, tight: bool = False) -> str:
    """The figure as an <svg> element to inline in a page (no XML prologue), and the figure closed."""
    if tight:
        fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", dpi=DPI, metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>", "", text, count=1, flags=re.S)
