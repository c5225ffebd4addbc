"""Lazy reader of a (possibly sharded) safetensors HF checkpoint and its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo


class HFCheckpoint:
    """Tensors are read one at a time, when a megatron parameter asks for them."""

    def __init__(self, path: Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise ProbeError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, "pt") as handle:
                self.files = {name: single for name in handle.keys()}
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ProbeError(f"{self.path}: missing weight '{name}'")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(name)


def read_hf_config(model: ModelInfo) -> dict:
    return json.loads((model.path / "config.json").read_text())
