"""A pass's measured peak memory, and freeing a configuration before the next one loads.

On a GPU the peak is `torch.cuda.max_memory_allocated` (its counters reset as the pass starts), summed over the
visible GPUs (one GPU's peak exactly; with device_map=auto an upper bound, each GPU's peak at its own moment). On the CPU it is
the process's peak resident memory: Linux's VmHWM, reset to the current resident size as the pass starts (writing
5 to /proc/self/clear_refs), so it is that pass's own peak; where the reset is refused or there is no /proc, the
process's peak since it started (getrusage's ru_maxrss), which only grows, and `of` says so.
"""

from __future__ import annotations

import gc
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

CUDA_PEAK = "cuda max_memory_allocated during the pass"
RSS_PEAK = "process peak resident memory during the pass (VmHWM, reset as it started)"
RSS_SINCE_START = "process peak resident memory since the process started (ru_maxrss; it only grows)"


def free_memory() -> None:
    """Return what dropped references held: cycles collected (an hf model with hooks holds some), and CUDA's cached
    blocks given back, so that the next configuration's load sees them free."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cuda(device: str) -> bool:
    torch = sys.modules.get("torch")
    return device.startswith("cuda") and torch is not None and torch.cuda.is_available()


def _status(key: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return None


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status("VmHWM") is not None


@dataclass
class Peak:
    bytes: int
    of: str


class PeakMeter:
    """`start()` as a pass begins, `stop()` as it ends: its peak bytes and what they measure."""

    def __init__(self, device: str):
        self.device, self.reset = device, False

    def start(self) -> None:
        if _cuda(self.device):
            import torch

            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
        else:
            self.reset = _reset_rss_peak()

    def stop(self) -> Peak:
        if _cuda(self.device):
            import torch

            peak = sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
            return Peak(bytes=int(peak), of=CUDA_PEAK)
        if self.reset:
            return Peak(bytes=int(_status("VmHWM") or 0), of=RSS_PEAK)
        scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
        return Peak(bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, of=RSS_SINCE_START)
