"""report/numbers.py: how each kind of number is written, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.report.numbers import count, percent, times, value, with_interval


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (41109, "41,109"),  # a count, never 4.111e+04
        (np.int64(1234567), "1,234,567"),
        (0, "0"),
        (0.0, "0"),
        (1.7123e-3, "1.71e-3"),
        (1.5e-3, "1.5e-3"),
        (2e-5, "2e-5"),
        (0.0523, "0.0523"),
        (0.1, "0.100"),
        (12.345, "12.3"),
        (1234.5, "1,230"),
        (-0.25, "-0.250"),
        (3.2e7, "3.2e7"),
        (float("nan"), "nan"),
        (None, "—"),
    ],
)
def test_value(x, text):
    assert value(x) == text


def test_interval_percent_times_and_count():
    assert with_interval(1.7123e-3, [1.5e-3, 1.9e-3]) == "1.71e-3 [1.5e-3, 1.9e-3]"
    assert with_interval(41109, None) == "41,109"
    assert percent(0.6243, [0.551, 0.7]) == "62.4% [55.1%, 70.0%]"
    assert times(11.24) == "11.2×"
    assert count(None) == "—" and count(1000) == "1,000"


def test_bounds_at_the_points_precision():
    # a routing share of 3.34% whose lower bound is a float's rounding away from 0
    assert percent(0.0334, [-7.91e-9, 0.102]) == "3.34% [0%, 10.2%]"
    assert percent(0.0334, [0.0101234, 0.102]) == "3.34% [1.01%, 10.2%]"
    assert with_interval(1.7123e-3, [3e-9, 1.9e-3]) == "1.71e-3 [0, 1.9e-3]"
    assert with_interval(1.7123e-3, [1.52345e-3, 2.0e-3]) == "1.71e-3 [1.52e-3, 2e-3]"
    assert with_interval(0.5, [0.0004, 0.9]) == "0.500 [0, 0.900]"  # below half the last digit (0.001)
    assert with_interval(12.345, [-0.04, 1234.5]) == "12.3 [0, 1,230]"
    assert times(0.488, [0.1234, 19.94]) == "0.488× [0.123×, 19.9×]"
    assert with_interval(0.0, [-1e-9, 1e-9]) == "0 [-1e-9, 1e-9]"  # a zero point has no precision to round to
    assert times(1.09, [0.604, 2.1]) == "1.09× [0.60×, 2.10×]"  # 0.604 at the point's last digit, not 0.600
