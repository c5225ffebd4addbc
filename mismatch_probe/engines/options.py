"""Engine options: each engine declares a dataclass; `--engine-arg KEY=VALUE` strings are checked against it.

A field's type converts the text (int, float, bool, str, or an optional of one); its metadata
carries the `help` line and an optional `min`. Values that are already typed (set from Python,
as the demo and the tests do) pass through the same checks.

A `prefix_option` field is a dict filled from dotted keys: `--engine-arg NAME.SUB=VALUE` puts VALUE
under SUB (text, unconverted: the engine's options dataclass checks the entries in its
`__post_init__`, against a schema of its own, such as megatron-core's TransformerConfig fields).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping

from mismatch_probe.errors import ProbeError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
NONE = ("", "none", "null")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """An engine without options of its own."""


def option(default, help: str, min: float | None = None):
    """A dataclass field with its `--help-engine` line and an optional lower bound."""
    return dataclasses.field(default=default, metadata={"help": help, "min": min})


def prefix_option(help: str):
    """A dict field taking every `--engine-arg NAME.SUB=VALUE` (listed by `--help-engine` as NAME.SUB)."""
    return dataclasses.field(default_factory=dict, metadata={"help": help, "prefix": True})


def split_engine_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ProbeError(f"--engine-arg '{text}': expected KEY=VALUE, e.g. concurrency=16")
    return key.strip(), value.strip()


def parse_engine_args(items: list[str]) -> dict[str, str]:
    """`--engine-arg` strings in order; a key given twice is refused rather than silently overridden."""
    args: dict[str, str] = {}
    for text in items:
        key, value = split_engine_arg(text)
        if key in args:
            raise ProbeError(f"--engine-arg {key}: given twice ({args[key]!r} and {value!r})")
        args[key] = value
    return args


def build_options(cls: type, engine: str, values: Mapping[str, object]):
    """An instance of the options dataclass `cls` from `values` (text or typed), every value checked."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    plain: dict[str, object] = {}
    prefixed: dict[str, dict] = {}
    for key, value in values.items():
        head, dot, sub = key.partition(".")
        if key in fields and not _is_prefix(fields[key]):
            plain[key] = _convert(key, value, hints[key], fields[key])
        elif head in fields and _is_prefix(fields[head]) and (sub or not dot):
            prefixed.setdefault(head, {}).update(_prefixed_entries(key, head, sub, value))
        else:
            raise ProbeError(f"--engine-arg {key}: unknown key for --engine {engine} ({valid_keys(cls)})")
    return cls(**plain, **prefixed)


def _is_prefix(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("prefix"))


def _prefixed_entries(key: str, head: str, sub: str, value) -> dict:
    """`NAME.SUB=VALUE` as {SUB: VALUE}; a whole mapping given as NAME (from Python) as itself."""
    if sub:
        return {sub: value}
    if isinstance(value, Mapping):
        return dict(value)
    raise ProbeError(f"--engine-arg {key}={value}: expected {head}.KEY=VALUE")


def _key_name(field: dataclasses.Field) -> str:
    return f"{field.name}.FIELD" if _is_prefix(field) else field.name


def valid_keys(cls: type) -> str:
    names = [_key_name(f) for f in dataclasses.fields(cls)]
    return f"valid keys: {', '.join(names)}" if names else "this engine takes no --engine-arg"


def option_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) per option, for `--help-engine`."""
    hints = typing.get_type_hints(cls)
    return [
        (
            _key_name(f),
            "by field" if _is_prefix(f) else type_name(hints[f.name]),
            "{}" if _is_prefix(f) else repr(f.default),
            f.metadata.get("help", ""),
        )
        for f in dataclasses.fields(cls)
    ]


def type_name(hint) -> str:
    inner = _optional_inner(hint)
    return f"{inner.__name__} or none" if inner is not None else hint.__name__


def _optional_inner(hint):
    """X for `X | None` / `Optional[X]`, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def _convert(key: str, value, hint, field: dataclasses.Field):
    inner = _optional_inner(hint)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in NONE):
            return None
        hint = inner
    expected = type_name(hint if inner is None else typing.Optional[hint])  # noqa: UP045 - its name is shown to the user
    converted = as_type(value, hint)
    if converted is None:
        raise ProbeError(f"--engine-arg {key}={value}: expected {expected}")
    low = field.metadata.get("min")
    if low is not None and converted < low:
        raise ProbeError(f"--engine-arg {key}={value}: expected {expected} >= {low:g}")
    return converted


def as_type(value, hint):
    """`value` as `hint` (int, float, bool or str), or None when it is not one."""
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        return True if text in TRUE else False if text in FALSE else None
    if hint is str:
        return value if isinstance(value, str) else None
    if isinstance(value, bool):
        return None
    if hint is int and isinstance(value, float):
        return None
    try:
        converted = hint(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        return None
    return converted if hint is not float or math.isfinite(converted) else None
