"""`probe import FORMAT PATH`: one reader per framework's dump format (docs/import.md)."""

from __future__ import annotations

import importlib
from enum import Enum


class DumpFormat(str, Enum):
    verl = "verl"
    slime = "slime"
    miles = "miles"
    prime_rl = "prime-rl"
    nemo_rl = "nemo-rl"


def reader(fmt: DumpFormat):
    """The `read(path) -> Dump` function of a format (imported on demand: some need torch)."""
    return importlib.import_module(f"mismatch_probe.importers.{fmt.name}").read
