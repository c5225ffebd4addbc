"""How every number is written for a person: the HTML report, the terminal, JUnit messages and `probe compare`.

Counts are integers with thousands separators (41,109); other values carry 3 significant digits, in
plain notation from 0.01 to 10^6 (0.0523, 12.3, 1,230) and as a short exponent outside it (1.71e-3);
an interval follows its value as `[low, high]`, its bounds at the value's precision (a bound within rounding of 0
is 0). One module, so a number reads the same everywhere."""

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


def _quantum(point) -> float | None:
    """The place of the last digit `value` writes the point to (1e-5 for 1.71e-3, 0.01 for 3.34); None for a
    count, zero, or a value that is no finite number."""
    if point is None or isinstance(point, bool) or not isinstance(point, numbers.Real) or _is_count(point):
        return None
    point = float(point)
    if not math.isfinite(point) or point == 0:
        return None
    rounded = float(f"{point:.{DIGITS}g}")
    return 10.0 ** (math.floor(math.log10(abs(rounded))) - (DIGITS - 1))


def bound(b, point=None) -> str:
    """An interval's bound at its point's precision: rounded to the point's last digit (or to its own third
    significant digit where that is coarser), so a bound within rounding of 0 is `0`, never `-7.91e-7` beside a
    point of 3.34, and 0.604 beside 1.09 is `0.60`."""
    q = _quantum(point)
    if q is None or b is None or isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b):
        return value(b)
    b = float(b)
    if abs(b) < q / 2:
        return "0"
    step = max(q, 10.0 ** (math.floor(math.log10(abs(b))) - (DIGITS - 1)))
    rounded = round(b / step) * step
    if not 0.01 <= abs(rounded) < 1e6:
        return value(rounded)
    return f"{rounded:,.{max(0, round(-math.log10(step)))}f}"


def interval(ci, point=None) -> str:
    """`[1.5e-3, 1.9e-3]`, each bound at the point's precision (`bound`); empty when there is no interval."""
    return f"[{bound(ci[0], point)}, {bound(ci[1], point)}]" if ci else ""


def with_interval(x, ci=None) -> str:
    """`1.71e-3 [1.52e-3, 1.9e-3]`, or the bare value when there is no interval."""
    if x is None:
        return MISSING
    return f"{value(x)} {interval(ci, x)}" if ci and isinstance(x, numbers.Real) else value(x)


def percent(x, ci=None) -> str:
    """`3.34% [0%, 10.2%]`: a share given as a fraction; bounds at the point's precision."""
    if x is None:
        return MISSING
    text = f"{value(100 * x)}%"
    return f"{text} [{bound(100 * ci[0], 100 * x)}%, {bound(100 * ci[1], 100 * x)}%]" if ci else text


def times(x, ci=None) -> str:
    """`11.2× [9.8×, 13×]`: a ratio; bounds at the point's precision."""
    if x is None:
        return MISSING
    text = f"{value(x)}×"
    return f"{text} [{bound(ci[0], x)}×, {bound(ci[1], x)}×]" if ci else text
