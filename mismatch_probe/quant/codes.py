"""Each weight scheme split into what a quantized checkpoint stores, its codes and its block scales, and the
float32 dequantization built back from them: `decode(encode(w))` is the scheme's value of `w` bit for bit
(schemes.py stays the reference: the same roundings, the same float32 products, on the same blocks).

Codes are stored as float8 e4m3fn bytes whatever the scheme: e4m3 codes are themselves, int4 codes (-8..7) and
e2m1 codes (0, ±0.5 ... ±6) are exact in e4m3. Scales are one float32 per block (`[*B, nr, 1, nc, 1]`), so a
quantized weight holds about one byte an element, where its float32 dequantization holds four.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.formats import E2M1_MAX, E4M3_MAX, e2m1, e4m3, e8m0_scale
from mismatch_probe.quant.schemes import FP8_WEIGHT_BLOCKS, INT4_MAX, INT4_MIN, _kept

CODE = torch.float8_e4m3fn
Split = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Join = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Codec:
    """A scheme's blocks, and its split of a block into (code values, scale) and join back into values."""

    rows: int
    cols: int
    split: Split  # (blocks, absmax, matrix absmax) -> (float32 code values, [*B, nr, 1, nc, 1] scales)
    join: Join  # (float32 code values, scales) -> float32 values


def _fp8(scale_of: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Split, Join]:
    def split(blocks, absmax, _matrix):
        scale = scale_of(absmax)
        return e4m3(blocks / scale), scale

    return split, lambda codes, scale: codes * scale


def _int4_split(blocks, absmax, _matrix):
    scale = _kept(absmax, absmax / INT4_MAX)
    return torch.round(blocks / scale).clamp(INT4_MIN, INT4_MAX), scale


def _nvfp4_split(blocks, absmax, matrix):
    s2 = _kept(matrix, matrix / (E2M1_MAX * E4M3_MAX))
    s2 = s2.reshape(*s2.shape, 1, 1, 1, 1)
    step = _kept(absmax, e4m3(absmax / E2M1_MAX / s2)) * s2
    safe = torch.where(step == 0, torch.ones_like(step), step)
    return torch.where(step == 0, torch.zeros_like(blocks), e2m1(blocks / safe)), step


def _nvfp4_join(codes, step):
    return torch.where(step == 0, torch.zeros_like(codes), codes * step)


def _marlin(dtype: torch.dtype) -> tuple[Split, Join]:
    """Marlin's int4-g128: the group scale stored in the run's dtype, code x scale rounded to it."""

    def split(blocks, absmax, matrix):
        codes, scale = _int4_split(blocks, absmax, matrix)
        return codes, scale.to(dtype).float()

    return split, lambda codes, scale: (codes * scale).to(dtype).float()


def codec(scheme: str, dtype: torch.dtype, marlin: bool = False) -> Codec:
    """The codec of weight scheme `scheme` (schemes.WEIGHT_SCHEMES) for a run in `dtype`."""
    fp8_absmax = _fp8(lambda a: _kept(a, a / E4M3_MAX))
    table = {
        **{name: (rows, cols, *fp8_absmax) for name, (rows, cols) in FP8_WEIGHT_BLOCKS.items()},
        "mxfp8": (1, 32, *_fp8(e8m0_scale)),
        "nvfp4": (1, 16, _nvfp4_split, _nvfp4_join),
        "int4-g128": (1, 128, *(_marlin(dtype) if marlin else (_int4_split, lambda codes, scale: codes * scale))),
    }
    rows, cols, split, join = table[scheme]
    return Codec(rows=rows, cols=cols, split=split, join=join)


def _blocks(w: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """`w` padded with zeros and cut into `[*B, nr, br, nc, bc]` blocks as blocks.blockwise cuts it, and the
    function that puts a tensor of that shape back into `w`'s."""
    rows, cols = w.shape[-2:]
    br = rows if codec.rows == WHOLE else min(codec.rows, rows)
    bc = cols if codec.cols == WHOLE else min(codec.cols, cols)
    pad_rows, pad_cols = -rows % br, -cols % bc
    padded = F.pad(w, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else w
    lead = padded.shape[:-2]
    nr, nc = padded.shape[-2] // br, padded.shape[-1] // bc

    def back(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols]

    return padded.reshape(*lead, nr, br, nc, bc), back


def encode(w: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn codes of `w`'s shape, block scales) of the matrices `w` `[*B, rows, cols]` (float32)."""
    w = w.float()
    matrix = w.abs().amax(dim=(-2, -1))
    blocks, back = _blocks(w, codec)
    codes, scale = codec.split(blocks, blocks.abs().amax(dim=(-3, -1), keepdim=True), matrix)
    return back(codes).to(CODE), scale


def decode(codes: torch.Tensor, scale: torch.Tensor, codec: Codec) -> torch.Tensor:
    """The float32 values of `codes` (e4m3fn, `[*B, rows, cols]`) with their block scales."""
    blocks, back = _blocks(codes.float(), codec)
    return back(codec.join(blocks, scale))


def element_scales(codes: torch.Tensor, scale: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Each element's block scale, float32, of `codes`' shape (what the kernel path reads per K chunk)."""
    blocks, back = _blocks(torch.zeros(codes.shape, device=codes.device), codec)
    return back(scale.expand_as(blocks))
