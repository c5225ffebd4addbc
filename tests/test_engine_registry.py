"""The engine registry names real classes, and the engine modules keep their layout: checked from the
source (importlib.util.find_spec and ast), so no torch-heavy engine module is imported."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from mismatch_probe import engines

ENTRIES = [(kind, name, target) for kind, table in engines.KINDS.items() for name, target in table.items()]
HEAVY = ("torch", "transformers", "megatron", "sglang", "vllm")


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module}: no such module"
    return Path(spec.origin)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    found |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return found


def test_the_registry_covers_both_kinds():
    assert set(engines.KINDS) == {"inference", "training"}
    assert engines.KINDS["inference"] is engines.INFERENCE and engines.KINDS["training"] is engines.TRAINING


@pytest.mark.parametrize(("kind", "name", "target"), ENTRIES, ids=[f"{k}-{n}" for k, n, _ in ENTRIES])
def test_every_entry_names_a_class_of_its_module(kind, name, target):
    module, cls = target.split(":")
    before = set(sys.modules)
    tree = ast.parse(_source(module).read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert cls in classes, f"{kind} engine '{name}': {module} defines no class {cls}"
    # find_spec imports the parent packages only: none of them may pull in an engine's heavy dependencies.
    assert not [m for m in set(sys.modules) - before if m.split(".")[0] in HEAVY]


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_in_process_and_server_engines_do_not_import_each_other(backend):
    offline = f"mismatch_probe.engines.{backend}.offline"
    server = f"mismatch_probe.engines.{backend}.server"
    assert server not in _imported_modules(_source(offline))
    assert offline not in _imported_modules(_source(server))
