"""Where the `hf` engines run: `--engine-arg device=auto|cpu|cuda|cuda:N`, or `device_map=auto` for a
model larger than one GPU (transformers spreads its layers over every visible GPU through accelerate).

The options are checked when they are built, so a CUDA device asked for where torch sees none is
refused (exit 2) before the run folder is touched or the model loaded.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

import torch

from mismatch_probe.engines.options import option
from mismatch_probe.errors import ProbeError

DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # transformers' own strategies
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class DeviceOptions:
    """Options of an `hf` engine that places the model on a device."""

    device: str = option("auto", f"{DEVICE_FORMS}; auto: the current CUDA device when torch sees one, else cpu")
    device_map: str | None = option(
        None,
        f"{', '.join(DEVICE_MAPS)}: spread a model larger than one GPU over every visible GPU "
        "(transformers' device_map, needs accelerate); leave device at auto",
    )

    def __post_init__(self) -> None:
        if not _DEVICE.fullmatch(self.device):
            raise ProbeError(f"--engine-arg device={self.device}: expected {DEVICE_FORMS}")
        if self.device_map is not None:
            _check_device_map(self.device_map, self.device)
        elif self.device.startswith("cuda"):
            _require_cuda(f"device={self.device}")
            index = int(self.device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ProbeError(
                    f"--engine-arg device={self.device}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                    f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
                )

    def torch_device(self) -> torch.device:
        """The one device of the model and its inputs (not used with device_map)."""
        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu" if self.device == "auto" else self.device)


def _check_device_map(device_map: str, device: str) -> None:
    what = f"device_map={device_map}"
    if device_map not in DEVICE_MAPS:
        raise ProbeError(f"--engine-arg {what}: expected one of {', '.join(DEVICE_MAPS)}")
    if device != "auto":
        raise ProbeError(f"--engine-arg {what} places the model itself; give device={device} or device_map, not both")
    _require_cuda(what)
    if importlib.util.find_spec("accelerate") is None:
        raise ProbeError(f"--engine-arg {what}: needs the accelerate package (pip install accelerate)")


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise ProbeError(
            f"--engine-arg {what}: CUDA is not available (torch {torch.__version__} sees no GPU); "
            "use device=cpu or device=auto"
        )


def model_devices(hf: torch.nn.Module) -> str:
    """The devices holding the model's weights, as the manifest records them: `cpu`, `cuda:0`, `cuda:0,cuda:1`."""
    devices = {p.device for p in hf.parameters()}
    return ",".join(str(d) for d in sorted(devices, key=lambda d: (d.type, -1 if d.index is None else d.index)))


def input_device(hf: torch.nn.Module) -> torch.device:
    """Where the token ids go: the device of the input embeddings (the first layer under device_map)."""
    return hf.get_input_embeddings().weight.device


def placement_facts(hf: torch.nn.Module, options: DeviceOptions) -> dict:
    """The manifest's record of where the model ran: the resolved device(s), and the device_map asked for."""
    return {"device": model_devices(hf)} | ({"device_map": options.device_map} if options.device_map else {})
