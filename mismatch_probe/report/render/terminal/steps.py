"""The per-step timeline as rows of text for the terminal: one row per step, at most MAX_ROWS rows.

Beyond MAX_ROWS steps, consecutive steps are binned into MAX_ROWS bins of about equal count. A bin's k3,
F(2) and mean |Δ| are pooled over its tokens (each step's value weighted by its tokens: exactly the value
over the bin's tokens); an interval, a correlation and a routed-row rate cannot be pooled from the steps'
values, so a bin shows none.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.report import numbers
from mismatch_probe.report.keys.families import EXTREME_FRACTION

MAX_ROWS = 30
HEADER = ("step", "tokens", "k3 [95%]", "F(2)", "mean |Δ|", "p corr", "router diff")
F2 = EXTREME_FRACTION.at(2)  # the report's per-step F(T), at T = 2
POOLED = ("k3_kl", F2, "abs_logprob_diff_mean")


def timeline(steps: list[dict], max_rows: int = MAX_ROWS) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(header, rows); a dense run's steps have no router column."""
    groups = [[steps[i] for i in group] for group in np.array_split(np.arange(len(steps)), min(max_rows, len(steps)))]
    rows = [_step_row(group[0]) if len(group) == 1 else _bin_row(group) for group in groups]
    if any("router_diff_rate" in entry for entry in steps):
        return HEADER, rows
    return HEADER[:-1], [row[:-1] for row in rows]


def _step_row(entry: dict) -> tuple[str, ...]:
    return (
        str(entry["step"]),
        numbers.value(entry["n_tokens"]),
        numbers.with_interval(entry["k3_kl"], entry["k3_kl_ci95"]),
        numbers.value(entry[F2]),
        numbers.value(entry["abs_logprob_diff_mean"]),
        numbers.value(entry["prob_corr"]),
        numbers.value(entry.get("router_diff_rate")),
    )


def _bin_row(group: list[dict]) -> tuple[str, ...]:
    n = sum(entry["n_tokens"] for entry in group)
    pooled = {
        key: sum(entry[key] * entry["n_tokens"] for entry in group if entry["n_tokens"]) / n if n else None
        for key in POOLED
    }
    return (
        f"{group[0]['step']}–{group[-1]['step']}",
        numbers.value(n),
        numbers.value(pooled["k3_kl"]),
        numbers.value(pooled[F2]),
        numbers.value(pooled["abs_logprob_diff_mean"]),
        "—",
        "—",
    )
