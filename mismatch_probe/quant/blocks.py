"""A batch of matrices `[*B, rows, cols]` cut into (block_rows x block_cols) blocks by padding with zeros and
reshaping: no Python loop per block. A block larger than a dimension shrinks to it; a partial block at an
edge holds its real elements and zeros, which leave its absmax unchanged."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

WHOLE = -1  # a block as long as the dimension


def blockwise(
    w: torch.Tensor, block_rows: int, block_cols: int, quantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`quantize(blocks, absmax)` applied to `w` (float32) cut into blocks, where `blocks` is
    `[*B, nr, br, nc, bc]` and `absmax` `[*B, nr, 1, nc, 1]`; the result has `w`'s shape."""
    rows, cols = w.shape[-2:]
    br = rows if block_rows == WHOLE else min(block_rows, rows)
    bc = cols if block_cols == WHOLE else min(block_cols, cols)
    pad_rows, pad_cols = -rows % br, -cols % bc
    padded = F.pad(w, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else w
    lead = padded.shape[:-2]
    nr, nc = padded.shape[-2] // br, padded.shape[-1] // bc
    blocks = padded.reshape(*lead, nr, br, nc, bc)
    absmax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    out = quantize(blocks, absmax).reshape(*lead, nr * br, nc * bc)
    return out[..., :rows, :cols]
