"""How every number is written for a person: the HTML report, the terminal, JUnit messages and `probe compare`.

Counts are integers with thousands separators (41,109); other values carry 3 significant digits, in
plain notation from 0.01 to 10^6 (0.0523, 12.3, 1,230) and as a short exponent outside it (1.71e-3);
an interval follows its value as `[low, high]`. One module, so a number reads the same everywhere."""

from __future__ import annotations

import math
import numbers

DIGITS = 3
MISSING = "—"


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def count(value) -> str:
    """`41,109`; `—` when absent."""
    return MISSING if value is None else f"{int(value):,}"


def value(x) -> str:
    """One number: a count as a count, anything else with 3 significant digits."""
    if x is None:
        return MISSING
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return str(x)
    if _is_count(x):
        return count(x)
    x = float(x)
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if x == 0:
        return "0"
    size = abs(x)
    if 0.01 <= size < 1e6:
        rounded = float(f"{x:.{DIGITS}g}")  # 3 significant digits, then written without an exponent
        decimals = max(0, DIGITS - 1 - math.floor(math.log10(abs(rounded))))
        return f"{rounded:,.{decimals}f}"
    mantissa, exponent = f"{x:.{DIGITS - 1}e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def interval(ci) -> str:
    """`[1.5e-3, 1.9e-3]`; empty when there is no interval."""
    return f"[{value(ci[0])}, {value(ci[1])}]" if ci else ""


def with_interval(x, ci=None) -> str:
    """`1.71e-3 [1.52e-3, 1.9e-3]`, or the bare value when there is no interval."""
    if x is None:
        return MISSING
    return f"{value(x)} {interval(ci)}" if ci and isinstance(x, numbers.Real) else value(x)


def percent(x, ci=None) -> str:
    """`62.4% [55.1%, 70%]`: a share given as a fraction."""
    if x is None:
        return MISSING
    text = f"{value(100 * x)}%"
    return f"{text} [{value(100 * ci[0])}%, {value(100 * ci[1])}%]" if ci else text


def times(x, ci=None) -> str:
    """`11.2× [9.8×, 13×]`: a ratio."""
    if x is None:
        return MISSING
    text = f"{value(x)}×"
    return f"{text} [{value(ci[0])}×, {value(ci[1])}×]" if ci else text
