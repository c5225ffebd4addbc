"""The operands of a quantized weight as a kernel reads them, in the parameter's stored layout (same shape and
strides, so that any view the model's forward takes of the parameter, `W[e]`, `W.t()`, maps to the same view of
each operand).

- `values`: codes x scales in float32, the dequantized weight the emulation multiplies with (float32
  operands: no rounding to the run's dtype, which no fp8 kernel has);
- `codes`, `scales` (the kernel path, fp8 schemes only): the e4m3fn codes and each element's block scale.

A quantized model keeps only what a quantized checkpoint stores (`StoredOperand`: codes and block scales,
codes.py); the float32 `Operand` is built when a product of its module first uses it in a forward, and dropped
when that forward returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mismatch_probe.quant.blocks import WHOLE

MARLIN_SCHEME = "int4-g128"  # the scheme whose `kernel` path is Marlin's arithmetic (emulated on every device)


@dataclass(frozen=True)
class Operand:
    """A quantized parameter's operands, each shaped and strided as the parameter."""

    parameter: torch.Tensor
    values: torch.Tensor
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    k_block: int = WHOLE  # the width of the weight's scale blocks along its input dimension

    def transposed(self) -> Operand:
        """The operands transposed in their last two dimensions (a weight used as `x @ W`, `W` `[..., K, N]`)."""
        return replace(self, values=_t(self.values), codes=_t(self.codes), scales=_t(self.scales))

    def view(self, w: torch.Tensor) -> Operand | None:
        """The operands of `w`, the parameter itself or a view of it; None for any other tensor."""
        if w is self.parameter:
            return self
        if w._base is not self.parameter:
            return None
        size, stride = w.size(), w.stride()
        offset = w.storage_offset() - self.parameter.storage_offset()

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.as_strided(size, stride, t.storage_offset() + offset)

        return replace(self, parameter=w, values=cut(self.values), codes=cut(self.codes), scales=cut(self.scales))


@dataclass(frozen=True)
class StoredOperand:
    """A quantized parameter as the model holds it, and how to build its float32 `Operand` for a forward."""

    parameter: torch.Tensor
    build: Callable[[], Operand]

    def owns(self, w: torch.Tensor) -> bool:
        """Whether `w` is the parameter itself or a view of it."""
        return w is self.parameter or w._base is self.parameter


def _t(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.transpose(-1, -2)


def laid_out_as(parameter: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (the parameter's shape) with the parameter's strides: `t` itself where it has them already, else a copy."""
    if t.stride() == parameter.stride() and t.device == parameter.device:
        return t
    out = torch.empty_strided(parameter.size(), parameter.stride(), dtype=t.dtype, device=parameter.device)
    return out.copy_(t)
