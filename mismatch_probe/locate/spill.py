"""Side a's records while side b runs, so that locate holds one configuration at a time.

Of each batch's record, b needs a's inputs (its own pass applies b's operations to them), a's router outputs
and routes (replayed in b's MoE mlp), and a's selected outputs, chosen experts and router scores (the tally's
reference); not a's module calls (b uses its own). Those are moved to the CPU and saved under
RUN/locate/.side-a/ as a runs, read back batch by batch as b runs, and removed once b is done. The round trip
moves tensors without changing a bit, so the comparison is the one made with both sides loaded at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mismatch_probe.locate.side import Record

KEPT = ("inputs", "outputs", "router_outputs", "routes", "chosen", "scores")


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(item) for item in value)
    return value


class Spill:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # an interrupted locate's leftovers
        self.folder.mkdir(parents=True)

    def _path(self, index: int) -> Path:
        return self.folder / f"batch-{index:05d}.pt"

    def put(self, index: int, record: Record) -> None:
        torch.save({key: _to_cpu(getattr(record, key)) for key in KEPT}, self._path(index))

    def get(self, index: int) -> Record:
        return Record(**torch.load(self._path(index), weights_only=True))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
