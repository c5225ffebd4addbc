"""Element formats and scales: e4m3fn (torch's cast, round to nearest even, after clamping to ±448), e2m1 (the
FP4 grid, ties to the even code, saturating at ±6) and the power-of-two e8m0 scale of MXFP8."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The e2m1 magnitudes, code 0 to 7, and the midpoints between neighbouring codes. A value exactly at a
# midpoint goes to the even code: down at 0.25, 1.25, 2.5 and 5; up at 0.75, 1.75 and 3.5.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32) rounded to float8 e4m3fn and back to float32; beyond ±448 it saturates."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32) rounded to the e2m1 grid: nearest, ties to the even code, ±6 beyond."""
    magnitude = x.abs()
    code = torch.zeros_like(x, dtype=torch.int64)
    for midpoint, tie_goes_up in _MIDPOINTS:  # seven constants, not a loop over the data
        code += (magnitude >= midpoint) if tie_goes_up else (magnitude > midpoint)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)
    return torch.where(x < 0, -grid[code], grid[code])


def e8m0_scale(absmax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(absmax / 448)) in float32, exact (from frexp, not a float log2), the exponent kept in
    e8m0's range [-127, 127]; 1 where absmax is 0. With it absmax / scale <= 448: the block never clips."""
    ratio = absmax.float() / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two
    exponent = exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(absmax == 0, torch.ones_like(scale), scale)
