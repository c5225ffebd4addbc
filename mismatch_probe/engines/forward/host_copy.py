"""Bringing a step's small results from the accelerator to the host in one copy.

A `.cpu()` of a CUDA tensor is a device-to-host copy the host waits for. Per decode step `hf`
generate has the sampled token's log-prob, the top-1, which rows the forward served, and the expert
ids and margins of every MoE layer: a hundred copies a step for a 48-layer model. Packed into one
float64 buffer they are one copy. float64 holds every float32, bf16 and fp16 value (NaN included),
every bool and every integer below 2**53 exactly, so each tensor comes back unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The values of `tensors`, flattened one after the other into one float64 vector on `device`."""
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped and typed as `like`, read back from `pack(like)` (wherever `flat` now is)."""
    sizes = [t.numel() for t in like]
    parts = torch.split(flat, sizes)
    return [part.view(t.shape).to(t.dtype) for part, t in zip(parts, like)]


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` on the CPU, with one device-to-host copy whatever their number; on the CPU already, as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    return unpack(pack(tensors, tensors[0].device).cpu(), tensors)
