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
    channels, shrinking to the dimension; e4m3fn; back in `x`'s dtype (DeepSeek-V3 / SGLang / vLLM block fp8)."""
    return _act_blocks(x, *ACT_BLOCKS["fp8-token128"])


def fp8_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic fp8, one scale (row absmax / 448) per token: vLLM's online `fp8` where CUTLASS runs it."""
    return _act_blocks(x, *ACT_BLOCKS["fp8-token"])


def fp8_tensor_act(x: torch.Tensor) -> torch.Tensor:
    """Dynamic fp8, one scale (absmax / 448) per call over all its tokens: SGLang's online `fp8`."""
    return _act_blocks(x, *ACT_BLOCKS["fp8-tensor"])


def _act_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).float()
    return blockwise(flat, rows, cols, _fp8_absmax).reshape(x.shape).to(x.dtype)


# (block rows, block cols) of each fp8 scheme on the matrix it quantizes: a weight `[out, in]`, an activation
# flattened to `[tokens, in]`. The kernel path reads its codes and scales from these.
FP8_WEIGHT_BLOCKS = {"fp8-block128": (128, 128), "fp8-channel": (1, WHOLE), "fp8-tensor": (WHOLE, WHOLE)}
ACT_BLOCKS = {"fp8-token128": (1, 128), "fp8-token": (1, WHOLE), "fp8-tensor": (WHOLE, WHOLE)}

ACT_SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8-token128": fp8_token128,
    "fp8-token": fp8_token,
    "fp8-tensor": fp8_tensor_act,
}


def fp8_codes_and_scales(w: torch.Tensor, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn codes, the float32 scale of each element's block), both of `w`'s shape: codes x scales is the
    scheme's dequantized value, exactly."""
    w = w.float()
    codes = blockwise(w, block_rows, block_cols, lambda b, a: e4m3(b / _kept(a, a / E4M3_MAX)))
    scales = blockwise(w, block_rows, block_cols, lambda b, a: _kept(a, a / E4M3_MAX).expand_as(b))
    return codes.to(torch.float8_e4m3fn), scales


def int4_g128_marlin(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int4-g128 as Marlin and Machete compute it (vLLM csrc/quantization/marlin/marlin_template.h `scale`,
    `__hmul2`): the code times the group scale stored in the activation dtype, the product rounded to that
    dtype; returned in float32 (exact values of `dtype`)."""

    def quantize(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        scale = _kept(absmax, absmax / INT4_MAX)
        codes = torch.round(blocks / scale).clamp(INT4_MIN, INT4_MAX)
        stored = scale.to(dtype).float()
        return (codes * stored).to(dtype).float()

    return blockwise(w.float(), 1, 128, quantize)
