"""The drift and trend as a person reads them, for the verdict, the terminal and the page."""

from __future__ import annotations

import math

from mismatch_probe.report import numbers


def drift_phrase(drift: dict | None) -> str | None:
    """'k3 rose 4.8× [3.9×, 6×] from step 23' (a drop: 'fell ... to 0.2× ...'); None for no drift."""
    if not drift:
        return None
    verb = "rose" if drift["direction"] == "rise" else "fell"
    return f"k3 {verb} {numbers.times(drift['ratio'], drift['ratio_ci95'])} from step {drift['step']}"


def trend_phrase(trend: dict | None) -> str | None:
    """'k3 grows 4.1% per step [3.2%, 5%]' when the slope's interval excludes 0, else None."""
    if not trend or not trend.get("slope_ci95"):
        return None
    low, high = trend["slope_ci95"]
    if low <= 0 <= high:
        return None
    per_step = [math.expm1(s) for s in (trend["slope"], low, high)]
    verb = "grows" if per_step[0] > 0 else "shrinks"
    return f"k3 {verb} {numbers.percent(abs(per_step[0]), sorted(abs(p) for p in per_step[1:]))} per step"
