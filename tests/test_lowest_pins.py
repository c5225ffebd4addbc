"""scripts/lowest_pins.py: the lowest CI lane's pins, generated from pyproject.toml (never copied by hand)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO
from packaging.requirements import Requirement

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

SCRIPT = REPO / "scripts" / "lowest_pins.py"
spec = importlib.util.spec_from_file_location("lowest_pins", SCRIPT)
lowest_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowest_pins)


def _pyproject(tmp_path, *dependencies: str):
    path = tmp_path / "pyproject.toml"
    lines = ", ".join(f"{d!r}" for d in dependencies)
    path.write_text(f'[project]\nname = "x"\ndependencies = [{lines}]\n')
    return path


def test_every_direct_dependency_but_torch_at_its_floor():
    pins = lowest_pins.lowest_pins(REPO / "pyproject.toml", {"torch"})
    declared = lowest_pins.tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = []
    for line in declared:
        requirement = Requirement(line)
        if requirement.name == "torch" or (requirement.marker and not requirement.marker.evaluate()):
            continue
        [floor] = [s.version for s in requirement.specifier if s.operator == ">="]
        wanted.append(f"{requirement.name}=={floor}")
    assert pins == wanted and len(pins) >= 10
    assert not any(pin.startswith(("torch==", "tomli==")) for pin in pins)  # skipped; a marker for Python < 3.11


def test_markers_extras_and_bounds(tmp_path):
    path = _pyproject(tmp_path, "a[x]>=1.2,<2", "b>=0.3; python_version < '3.0'", "c~=4.1", "torch>=2.6")
    assert lowest_pins.lowest_pins(path, {"torch"}) == ["a==1.2", "c==4.1"]
    assert lowest_pins.lowest_pins(path, set())[-1] == "torch==2.6"


@pytest.mark.parametrize("dependency", ["d", "d<3", "d>1"])
def test_a_dependency_without_a_floor_exits_2(tmp_path, dependency):
    path = _pyproject(tmp_path, "a>=1", dependency)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--pyproject", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"lowest_pins: {path}: {dependency!r} has no single lower bound (>=, ~= or ==) to pin\n"
