"""A logged sample's fields, checked where they are read: numbers of the expected kind, shape and range, or one
line naming the sample and the field (exit 2).

Dumps are other programs' output, often copied from elsewhere: a field of the wrong type, a ragged list, a NaN
or negative token id is an error that says where, never a traceback and never a value silently cast (numpy
would turn 1.5 into 1 and NaN into an arbitrary integer). The importers read every field they use through
these functions, under the dump's own field names; `LoggedRunWriter` checks what it is given the same way.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.errors import ProbeError

MAX_LOGPROB = 1e-3  # a log-probability above this is not a log-probability (rounding allowed)
ID_LIMIT = 2**31  # a token or expert id without a known vocabulary: 0 <= id < 2**31 (every vocabulary fits int32)


def short(value) -> str:
    """A value's repr on one line, at most 60 characters: for messages that quote what a dump holds."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(value) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 1e18 else repr(value)


def numbers(values, where: str, name: str, ndim: int | None = 1) -> np.ndarray:
    """`values` (a list, a numpy array or a torch tensor, on any device) as a numeric array of `ndim`
    dimensions (any, for None); None in a list (a JSON null) is NaN."""
    try:
        if hasattr(values, "detach"):  # a torch tensor; torch is not imported here
            values = values.detach().cpu()
            values = (values.float() if values.is_floating_point() and values.element_size() < 4 else values).numpy()
        array = np.asarray(values)
        if array.dtype == object:  # a list holding None, or Python ints past int64
            if not all(v is None or isinstance(v, (int, float, np.number)) for v in array.flat):
                raise TypeError("not all numbers")
            array = array.astype(np.float64)
    except Exception:  # noqa: BLE001 - whatever numpy makes of it (ragged, nested, recursive), it is not numbers
        array = None
    if array is None or array.dtype.kind not in "biuf":
        what = (
            f"is of type {type(values).__name__}" if array is None or array.ndim == 0 else f"holds {array.dtype} values"
        )
        raise ProbeError(f"{where}: '{name}' {what}, expected {_expected(ndim)}")
    if ndim is not None and array.ndim != ndim:
        raise ProbeError(f"{where}: '{name}' has {array.ndim} dimensions {array.shape}, expected {_expected(ndim)}")
    return array


def _expected(ndim: int) -> str:
    return {0: "a number", 1: "a list of numbers"}.get(ndim, f"a {ndim}-dimensional array of numbers")


def ids(values, where: str, name: str, limit: int = ID_LIMIT, ndim: int = 1, what: str = "token id") -> np.ndarray:
    """Whole numbers 0 <= id < limit, as int64 (token ids, expert ids)."""
    array = numbers(values, where, name, ndim)
    if array.dtype.kind == "b":
        raise ProbeError(f"{where}: '{name}' holds true/false values, expected {what}s")
    if array.size:
        if array.dtype.kind == "f":
            bad = ~np.isfinite(array) | (array != np.floor(array))
            if bad.any():
                raise ProbeError(f"{where}: '{name}' holds {_shown(array[bad][0])}, expected whole-number {what}s")
        low, high = array.min().item(), array.max().item()  # Python numbers: a float16 array cannot hold `limit`
        if low < 0 or high >= limit:
            raise ProbeError(
                f"{where}: '{name}' holds {what} {_shown(low if low < 0 else high)}, out of range "
                f"(expected 0 <= {what.split()[-1]} < {limit})"
            )
    return array.astype(np.int64, copy=False)


def count(value, where: str, name: str) -> int:
    """A whole number >= 0 (a length)."""
    return int(ids(value, where, name, ndim=0, what="length"))


def logprobs(values, where: str, name: str) -> np.ndarray:
    """Log-probs as floats (float64 unless given as float32); NaN, inf and null are kept: such a token has
    no log-prob."""
    array = numbers(values, where, name)
    if array.dtype.kind == "b":
        raise ProbeError(f"{where}: '{name}' holds true/false values, expected log-probs")
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float64)


def at_most_zero(values: np.ndarray, where: str, name: str) -> None:
    """The compared log-probs are log-probabilities: none above MAX_LOGPROB (the report refuses them too)."""
    above = values[values > MAX_LOGPROB]
    if above.size:
        raise ProbeError(f"{where}: {name} hold {float(above[0]):.6g} > 0, expected log-probabilities <= 0")


def flags(values, where: str, name: str) -> np.ndarray:
    """A mask of booleans or numbers (non-zero is true), as bool."""
    array = numbers(values, where, name)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ProbeError(f"{where}: '{name}' holds {_shown(array[~np.isfinite(array)][0])}, expected 0/1 flags")
    return array != 0


def lengths_agree(where: str, arrays: dict[str, np.ndarray], expected: int, what: str) -> None:
    """Each named array holds `expected` values (one per token of `what`)."""
    for name, array in arrays.items():
        if len(array) != expected:
            raise ProbeError(f"{where}: '{name}' has {len(array)} values, expected {expected} (one per {what})")
