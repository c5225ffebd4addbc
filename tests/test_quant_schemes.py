"""Known answers for each fake-quant scheme (issue 40): the vectorised torch code against a direct per-block,
per-element implementation in Python and numpy float32 that never uses torch's float8 cast or the padding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mismatch_probe.quant import schemes
from mismatch_probe.quant.apply import quantized_weight
from mismatch_probe.quant.formats import e2m1, e4m3, e8m0_scale
from mismatch_probe.quant.targets import Target

F32 = np.float32

# ---- the direct implementation ---------------------------------------------------------------------------


def e4m3_ref(v: float) -> float:
    """Round to nearest even on the e4m3fn grid (3 mantissa bits, min normal 2^-6, subnormal step 2^-9),
    saturating at 448."""
    a = min(abs(float(v)), 448.0)
    if a == 0:
        return 0.0
    _, exponent = math.frexp(a)  # a = m * 2^exponent, m in [0.5, 1): floor(log2 a) = exponent - 1
    quantum = 2.0 ** (max(exponent - 1, -6) - 3)
    return math.copysign(float(np.round(a / quantum)) * quantum, v)  # np.round: half to even


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_ref(v: float) -> float:
    a = abs(float(v))
    distances = [abs(a - g) for g in E2M1]
    best = min(distances)
    codes = [c for c, d in enumerate(distances) if d == best]
    code = next((c for c in codes if c % 2 == 0), codes[0])  # a tie goes to the even code
    return math.copysign(E2M1[code], v)


def blocks(rows: int, cols: int, br: int, bc: int):
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            yield slice(i, i + br), slice(j, j + bc)  # numpy slices stop at the edge: partial blocks


def fp8_ref(w: np.ndarray, br: int, bc: int, pow2: bool = False) -> np.ndarray:
    out = np.empty_like(w)
    for rs, cs in blocks(*w.shape, br, bc):
        block = w[rs, cs]
        amax = F32(np.abs(block).max())
        if amax == 0:
            scale = F32(1)
        elif pow2:
            exponent = min(max(math.ceil(math.log2(float(F32(amax / F32(448))))), -127), 127)
            scale = F32(2.0**exponent)
        else:
            scale = F32(amax / F32(448))
        codes = np.vectorize(e4m3_ref)((block / scale).astype(F32)).astype(F32)
        out[rs, cs] = codes * scale
    return out


def int4_ref(w: np.ndarray) -> np.ndarray:
    out = np.empty_like(w)
    for rs, cs in blocks(*w.shape, 1, 128):
        amax = F32(np.abs(w[rs, cs]).max())
        scale = F32(amax / F32(7)) if amax else F32(1)
        out[rs, cs] = np.clip(np.round(w[rs, cs] / scale), -8, 7).astype(F32) * scale
    return out


def nvfp4_ref(w: np.ndarray) -> np.ndarray:
    amax = F32(np.abs(w).max())
    s2 = F32(amax / F32(6 * 448)) if amax else F32(1)
    out = np.empty_like(w)
    for rs, cs in blocks(*w.shape, 1, 16):
        block = w[rs, cs]
        bmax = F32(np.abs(block).max())
        sb = F32(e4m3_ref(F32(F32(bmax / F32(6)) / s2))) if bmax else F32(1)
        step = F32(sb * s2)
        if step == 0:
            out[rs, cs] = 0
            continue
        out[rs, cs] = np.vectorize(e2m1_ref)((block / step).astype(F32)).astype(F32) * step
    return out


REFERENCES = {
    "fp8-block128": lambda w: fp8_ref(w, 128, 128),
    "fp8-channel": lambda w: fp8_ref(w, 1, w.shape[1]),
    "fp8-tensor": lambda w: fp8_ref(w, *w.shape),
    "mxfp8": lambda w: fp8_ref(w, 1, 32, pow2=True),
    "nvfp4": nvfp4_ref,
    "int4-g128": int4_ref,
}


def matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-6, 2, (rows, 1)))  # rows of very different size
    w[rng.random((rows, cols)) < 0.01] *= 40  # outliers
    return w.astype(F32)


# ---- the schemes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", list(schemes.WEIGHT_SCHEMES))
@pytest.mark.parametrize("shape", [(37, 300), (130, 70), (257, 129), (5, 7), (1, 33)])
def test_each_scheme_equals_the_direct_implementation(scheme, shape):
    w = matrix(*shape, seed=sum(shape))
    got = schemes.WEIGHT_SCHEMES[scheme](torch.from_numpy(w))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), REFERENCES[scheme](w))


@pytest.mark.parametrize("scheme", list(schemes.WEIGHT_SCHEMES))
def test_a_batch_of_experts_is_quantized_one_matrix_at_a_time(scheme):
    w = np.stack([matrix(40, 150, seed=s) for s in range(3)])
    got = schemes.WEIGHT_SCHEMES[scheme](torch.from_numpy(w)).numpy()
    for expert in range(3):
        np.testing.assert_array_equal(got[expert], REFERENCES[scheme](w[expert]))


@pytest.mark.parametrize("scheme", list(schemes.WEIGHT_SCHEMES))
def test_bf16_weights_are_quantized_as_loaded_and_returned_in_bf16(scheme):
    w = torch.from_numpy(matrix(33, 140, seed=3)).bfloat16()
    got = schemes.WEIGHT_SCHEMES[scheme](w)
    assert got.dtype == torch.bfloat16
    expected = REFERENCES[scheme](w.float().numpy())
    assert torch.equal(got, torch.from_numpy(expected).bfloat16())


def test_a_block_larger_than_the_matrix_shrinks_to_it():
    w = torch.from_numpy(matrix(5, 7, seed=1))
    assert torch.equal(schemes.fp8_block128(w), schemes.fp8_tensor(w))
    assert torch.equal(schemes.mxfp8(w[:, :7]), schemes.WEIGHT_SCHEMES["mxfp8"](w))


def test_zero_blocks_stay_zero_and_keep_scale_one():
    w = torch.zeros(4, 64)
    w[0, :3] = torch.tensor([1.0, -2.0, 0.5])
    for fn in schemes.WEIGHT_SCHEMES.values():
        got = fn(w)
        assert torch.isfinite(got).all() and torch.equal(got[1:], w[1:])
        assert fn(torch.zeros(3, 20)).eq(0).all()


# ---- the element formats ----------------------------------------------------------------------------------


def test_e4m3_is_round_to_nearest_even_and_saturates():
    values = [448.0, 464.0, 465.0, 1e6, 240.0, 248.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 17.0, 0.3]
    sweep = np.concatenate([values, -np.array(values), np.random.default_rng(0).standard_normal(2000) * 50])
    x = torch.tensor(sweep, dtype=torch.float32)
    np.testing.assert_array_equal(e4m3(x).numpy(), np.vectorize(e4m3_ref)(x.numpy()).astype(F32))
    assert e4m3(torch.tensor([464.0, -1e6, 2.0**-10, 1.0625])).tolist() == [448.0, -448.0, 0.0, 1.0]


def test_e2m1_ties_go_to_the_even_code_and_saturate_at_6():
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for value, rounded in ties.items():
        assert e2m1(torch.tensor([value, -value])).tolist() == [rounded, -rounded]
    assert e2m1(torch.tensor([6.0, 7.0, 1e9, -100.0, 0.26, 5.01])).tolist() == [6.0, 6.0, 6.0, -6.0, 0.5, 6.0]
    x = torch.from_numpy((np.random.default_rng(1).standard_normal(3000) * 3).astype(F32))
    x = torch.cat([x, torch.arange(-28, 29) * 0.25])  # every quarter: the ties and the grid
    np.testing.assert_array_equal(e2m1(x).numpy(), np.vectorize(e2m1_ref)(x.numpy()).astype(F32))


def test_e8m0_scale_corner_cases():
    absmax = torch.tensor([448.0, 448.0 * 4, 448.0 * 2**-20, 449.0, 447.0, 0.0, 1e-42, 448.0 * 2**-130, 3e38])
    expected = [1.0, 4.0, 2.0**-20, 2.0, 1.0, 1.0, 2.0**-127, 2.0**-127, 2.0**120]  # 3e38 / 448 < 2^120
    assert e8m0_scale(absmax).tolist() == expected
    # absmax exactly 448 * 2^k is not clipped: it maps to 448 itself
    w = torch.full((1, 32), 0.5)
    w[0, 5] = 448.0 * 4
    assert schemes.mxfp8(w)[0, 5].item() == 448.0 * 4
    # tiny values: a power-of-two scale never clips, so the block's absmax element survives
    tiny = torch.tensor([[3e-38, -1e-39, 1e-40]])
    got = schemes.mxfp8(tiny)
    np.testing.assert_array_equal(got.numpy(), fp8_ref(tiny.numpy(), 1, 32, pow2=True))


def test_nvfp4_two_level_scale():
    w = torch.zeros(1, 48)
    w[0, :16] = torch.linspace(-12.0, 12.0, 16)  # block 0 holds the tensor's absmax: sb = e4m3(448) = 448
    w[0, 16:32] = torch.linspace(-0.03, 0.03, 16)  # block 1: sb = e4m3(0.03 / 6 / s2)
    s2 = 12.0 / (6 * 448)
    got = schemes.nvfp4(w)
    step0 = 448.0 * np.float32(s2)
    assert got[0, 0].item() == pytest.approx(-6 * step0, rel=1e-6) and got[0, 15].item() == pytest.approx(6 * step0)
    sb1 = e4m3_ref(float(F32(F32(0.03) / F32(6)) / F32(s2)))
    assert sb1 != 0.03 / 6 / s2  # the block scale itself is rounded to e4m3
    np.testing.assert_array_equal(got.numpy(), nvfp4_ref(w.numpy()))
    assert got[0, 32:].eq(0).all()  # an all-zero block


def test_act_fp8_token128_one_scale_per_token_and_128_channels():
    x = torch.from_numpy(np.stack([matrix(6, 300, seed=s) for s in range(2)]))
    got = schemes.fp8_token128(x)
    for b in range(2):
        np.testing.assert_array_equal(got[b].numpy(), fp8_ref(x[b].numpy(), 1, 128))
    assert schemes.fp8_token128(x.bfloat16()).dtype == torch.bfloat16


# ---- fused expert parameters ------------------------------------------------------------------------------


class _Experts(torch.nn.Module):
    def __init__(self, w: torch.Tensor, **flags):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(w)
        for key, value in flags.items():
            setattr(self, key, value)


@pytest.mark.parametrize("transposed, layout", [(False, "concatenated"), (True, "concatenated"), (True, "interleaved")])
def test_fused_gate_up_is_quantized_as_separate_gate_and_up_matrices(transposed, layout):
    experts, inner, hidden = 3, 20, 24
    gate = torch.from_numpy(np.stack([matrix(inner, hidden, seed=s) for s in range(experts)]))
    up = torch.from_numpy(np.stack([matrix(inner, hidden, seed=10 + s) * 100 for s in range(experts)]))
    if layout == "concatenated":
        fused = torch.cat([gate, up], dim=1)  # [E, 2I, H]: output rows gate then up
    else:
        fused = torch.stack([gate, up], dim=2).reshape(experts, 2 * inner, hidden)  # gate0, up0, gate1, ...
    stored = fused.transpose(1, 2).contiguous() if transposed else fused
    module = _Experts(stored)
    target = Target("x.gate_up_proj", module, "gate_up_proj", experts=True, transposed=transposed, gate_up=layout)
    got = quantized_weight(target, schemes.fp8_tensor)
    got = got.transpose(1, 2) if transposed else got
    halves = (got[:, :inner], got[:, inner:]) if layout == "concatenated" else (got[:, 0::2], got[:, 1::2])
    for half, original in zip(halves, (gate, up)):
        for e in range(experts):
            np.testing.assert_array_equal(half[e].numpy(), fp8_ref(original[e].numpy(), inner, hidden))
