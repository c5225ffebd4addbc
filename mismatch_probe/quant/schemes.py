"""The weight schemes of `weight_quant=` and the activation scheme of `act_quant=`, each a fake quant:
quantize, then dequantize, computed in float32 and returned in the input's dtype.

A weight is `[*B, out, in]` (a batch of matrices: one per expert of a fused parameter); "along the input
dimension" is along the last axis. A per-tensor scale is one per matrix. An all-zero block keeps scale 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mismatch_probe.quant.blocks import WHOLE, blockwise
from mismatch_probe.quant.formats import E2M1_MAX, E4M3_MAX, e2m1, e4m3, e8m0_scale

INT4_MIN, INT4_MAX = -8, 7


def _kept(absmax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.where(absmax == 0, torch.ones_like(scale), scale)


def _fp8_absmax(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    scale = _kept(absmax, absmax / E4M3_MAX)
    return e4m3(blocks / scale) * scale


def _fp8_pow2(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    scale = e8m0_scale(absmax)
    return e4m3(blocks / scale) * scale


def _int4(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    scale = _kept(absmax, absmax / INT4_MAX)
    return torch.round(blocks / scale).clamp(INT4_MIN, INT4_MAX) * scale  # round half to even


def _in_dtype(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(w: torch.Tensor) -> torch.Tensor:
        return fn(w.float()).to(w.dtype)

    run.__doc__ = fn.__doc__
    return run


@_in_dtype
def fp8_block128(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn, 128x128 blocks, scale = block absmax / 448 (DeepSeek-V3 / SGLang / vLLM block fp8)."""
    return blockwise(w, 128, 128, _fp8_absmax)


@_in_dtype
def fp8_channel(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn, one scale per output row: row absmax / 448."""
    return blockwise(w, 1, WHOLE, _fp8_absmax)


@_in_dtype
def fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn, one scale per matrix: absmax / 448."""
    return blockwise(w, WHOLE, WHOLE, _fp8_absmax)


@_in_dtype
def mxfp8(w: torch.Tensor) -> torch.Tensor:
    """e4m3fn, blocks of 32 along the input dimension, scale 2^ceil(log2(absmax / 448))."""
    return blockwise(w, 1, 32, _fp8_pow2)


@_in_dtype
def nvfp4(w: torch.Tensor) -> torch.Tensor:
    """e2m1, blocks of 16 along the input dimension: s2 = absmax / (6 * 448) per matrix, sb = e4m3(block
    absmax / 6 / s2) per block, element = e2m1(w / (sb * s2)) * sb * s2. A block whose sb rounds to 0 is 0."""
    tensor_absmax = w.abs().amax(dim=(-2, -1))
    s2 = _kept(tensor_absmax, tensor_absmax / (E2M1_MAX * E4M3_MAX))
    s2 = s2.reshape(*s2.shape, 1, 1, 1, 1)  # against [*B, nr, br, nc, bc]

    def quantize(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        sb = _kept(absmax, e4m3(absmax / E2M1_MAX / s2))
        step = sb * s2
        safe = torch.where(step == 0, torch.ones_like(step), step)
        return torch.where(step == 0, torch.zeros_like(blocks), e2m1(blocks / safe) * step)

    return blockwise(w, 1, 16, quantize)


@_in_dtype
def int4_g128(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4, groups of 128 along the input dimension, scale = absmax / 7, values in [-8, 7]."""
    return blockwise(w, 1, 128, _int4)


WEIGHT_SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8-block128": fp8_block128,
    "fp8-channel": fp8_channel,
    "fp8-tensor": fp8_tensor,
    "mxfp8": mxfp8,
    "nvfp4": nvfp4,
    "int4-g128": int4_g128,
}


def fp8_token128(x: torch.Tensor) -> torch.Tensor:
    """Dynamic fp8 of an activation `[..., in]`: one scale (group absmax / 448) per token and per 128 input
    channels, shrinking to the dimension; e4m3fn; back in `x`'s dtype."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return blockwise(flat, 1, 128, _fp8_absmax).reshape(x.shape).to(x.dtype)


ACT_SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp8-token128": fp8_token128}
