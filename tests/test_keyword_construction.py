"""Every dataclass of the package is built with keyword arguments: a positional call silently misroutes its
values the day a field is added or reordered (a command line flag that never reached its job did just that)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil

from conftest import REPO

import mismatch_probe

PACKAGE = REPO / "mismatch_probe"


def _init_field_counts() -> dict[str, int]:
    """Class name -> how many fields its __init__ takes, for every dataclass the package defines."""
    counts: dict[str, int] = {}
    for info in pkgutil.walk_packages(mismatch_probe.__path__, "mismatch_probe."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional engine's library is not installed here
            continue
        for name, cls in inspect.getmembers(module, dataclasses.is_dataclass):
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                counts[name] = max(counts.get(name, 0), sum(f.init for f in dataclasses.fields(cls)))
    return counts


def positional_constructions(counts: dict[str, int]) -> list[str]:
    """`file:line: call` for each call of a package dataclass of two or more fields with a positional argument
    (a one-field dataclass, `Run(path)`, cannot misroute)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if counts.get(name, 0) > 1:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_the_check_sees_the_package_dataclasses():
    counts = _init_field_counts()
    assert counts["SamplingParams"] == 6 and counts["MoeShape"] == 3
    assert counts["RescoreJob"] > 10 and counts["GenerateJob"] > 10 and counts["RoutingAdapter"] >= 9
    assert counts["Run"] == 1  # its other fields are derived (init=False)


def test_package_dataclasses_are_built_with_keywords():
    assert positional_constructions(_init_field_counts()) == []
