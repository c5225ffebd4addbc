"""A pass's measured peak memory, and freeing a configuration before the next one loads.

On a GPU the peak is `torch.cuda.max_memory_allocated` (its counters reset as the pass starts), summed over the
visible GPUs (one GPU's peak exactly; with device_map=auto an upper bound, each GPU's peak at its own moment).
On the CPU it is the process's peak resident memory so far, read as the pass ends (getrusage's ru_maxrss): it
only grows, so a pass's own peak shows where it rises above the passes before it. It is not reset (Linux could,
through /proc/self/clear_refs): that would also reset what GNU time and a parent's wait4 report for the process.
"""

from __future__ import annotations

import gc
import resource
import sys
from dataclasses import dataclass

CUDA_PEAK = "cuda max_memory_allocated during the pass"
RSS_SINCE_START = "process peak resident memory since it started, at the end of the pass (ru_maxrss; it only grows)"


def free_memory() -> None:
    """Return what dropped references held: cycles collected (an hf model with hooks holds some), and CUDA's cached
    blocks given back, so that the next configuration's load sees them free."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cuda(device: str) -> bool:
    torch = sys.modules.get("torch")
    on_gpu = device.startswith("cuda") or device == "auto"  # auto: device_map over the GPUs (and the CPU)
    return on_gpu and torch is not None and torch.cuda.is_available()


@dataclass
class Peak:
    bytes: int
    of: str


class PeakMeter:
    """`start()` as a pass begins, `stop()` as it ends: its peak bytes and what they measure."""

    def __init__(self, device: str):
        self.device = device

    def start(self) -> None:
        if _cuda(self.device):
            import torch

            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)

    def stop(self) -> Peak:
        if _cuda(self.device):
            import torch

            peak = sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
            return Peak(bytes=int(peak), of=CUDA_PEAK)
        scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
        return Peak(bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, of=RSS_SINCE_START)
