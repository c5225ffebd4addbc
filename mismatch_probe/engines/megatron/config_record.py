"""The manifest's record of the built TransformerConfig and of the overrides: JSON, every value that can be."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping

import torch

_SKIP = object()


def json_safe(value):
    """`value` as JSON: dtypes and enums as their names, callables by qualified name; _SKIP where impossible."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        items = [json_safe(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, Mapping):
        items = {str(k): json_safe(v) for k, v in value.items()}
        return _SKIP if any(i is _SKIP for i in items.values()) else items
    if callable(value):
        target = getattr(value, "func", value)  # functools.partial
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
        return f"{getattr(target, '__module__', '')}.{name}".lstrip(".") if name else _SKIP
    return _SKIP


def config_record(config) -> dict:
    """Every field of a built TransformerConfig that JSON can hold."""
    record = {}
    for field in dataclasses.fields(config):
        value = json_safe(getattr(config, field.name))
        if value is not _SKIP:
            record[field.name] = value
    json.dumps(record)  # a value json_safe let through that JSON cannot hold is a bug here, not in the run
    return record


def overrides_record(overrides: Mapping[str, object]) -> dict:
    return {k: v for k, v in ((k, json_safe(v)) for k, v in overrides.items()) if v is not _SKIP}
