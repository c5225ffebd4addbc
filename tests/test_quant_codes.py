"""Quantized weights held as their codes and block scales (quant/codes.py), the float32 operand built per
forward: each scheme's codes x scales equal its fake quant (schemes.py) bit for bit, and a quantized model's
logits equal those of operands built eagerly from the schemes, as they were kept beside each weight before,
on the emulate and the kernel path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mismatch_probe.quant import schemes
from mismatch_probe.quant.apply import quantize_model, quantized_weight
from mismatch_probe.quant.codes import codec, decode, element_scales, encode
from mismatch_probe.quant.compute import QuantProducts
from mismatch_probe.quant.operands import Operand, StoredOperand, laid_out_as
from mismatch_probe.quant.targets import DEFAULT_SKIP, find_targets, split_targets

IDS = torch.tensor([[5, 9, 33, 2, 70, 11, 4, 8, 60], [3, 3, 17, 90, 41, 6, 7, 12, 2]])


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 300, generator=g) * torch.rand(3, 200, 1, generator=g) * 5  # partial blocks
    w[0, :130, :128] = 0  # an all-zero block keeps scale 1
    w[1, 7] = 1e-30  # a row of tiny values (nvfp4's block scale rounds to 0)
    return [w, w[2].to(torch.bfloat16).float(), torch.randn(64, 16, generator=g)]


@pytest.mark.parametrize("scheme", sorted(schemes.WEIGHT_SCHEMES))
def test_codes_times_scales_are_the_scheme_bit_for_bit(scheme):
    for w in _weights():
        c = codec(scheme, torch.bfloat16)
        codes, scale = encode(w, c)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
        assert scale.numel() < w.numel() or w.shape[-1] <= 16
        got = decode(codes, scale, c)
        assert torch.equal(got.view(torch.int32), schemes.WEIGHT_SCHEMES[scheme](w).view(torch.int32))


def test_marlin_codes_and_fp8_kernel_scales():
    for w in _weights():
        marlin = codec("int4-g128", torch.bfloat16, marlin=True)
        codes, scale = encode(w, marlin)
        assert torch.equal(decode(codes, scale, marlin), schemes.int4_g128_marlin(w, torch.bfloat16))
        for scheme, (rows, cols) in schemes.FP8_WEIGHT_BLOCKS.items():
            c = codec(scheme, torch.bfloat16)
            codes, scale = encode(w, c)
            want_codes, want_scales = schemes.fp8_codes_and_scales(w, rows, cols)
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
            assert torch.equal(element_scales(codes, scale, c), want_scales)


def _fp8_parts(w: torch.Tensor, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
    return schemes.fp8_codes_and_scales(w, *schemes.FP8_WEIGHT_BLOCKS[weight])


def _eager(model, weight: str, act: str | None, kernel: bool) -> None:
    """Quantized as before codes.py: each weight's float32 values (and the kernel's codes and per-element scales)
    computed from the scheme at once and kept, the parameter holding the values in the run's dtype."""
    quantized, _ = split_targets(find_targets(model), DEFAULT_SKIP)
    modules: dict[int, tuple] = {}
    for target in quantized:
        source = target.parameter.detach().float()
        values = quantized_weight(target, schemes.WEIGHT_SCHEMES[weight], source=source)
        target.parameter.data.copy_(values.to(target.parameter.dtype))
        parameter = target.parameter
        operand = Operand(parameter=parameter, values=laid_out_as(parameter, values), k_block=128)
        if kernel:
            codes = quantized_weight(target, lambda w: _fp8_parts(w, weight)[0], source=source)
            scales = quantized_weight(target, lambda w: _fp8_parts(w, weight)[1], source=source)
            operand = Operand(
                parameter=parameter,
                values=operand.values,
                codes=laid_out_as(parameter, codes),
                scales=laid_out_as(parameter, scales),
                k_block=128,
            )
        stored = StoredOperand(parameter=parameter, build=lambda operand=operand: operand)
        modules.setdefault(id(target.module), (target.module, []))[1].append(stored)
    for module, operands in modules.values():
        mode = QuantProducts(operands, act, kernel)
        module.register_forward_pre_hook(mode.enter)
        module.register_forward_hook(mode.exit, always_call=True)


@pytest.mark.parametrize(
    ("weight", "act", "compute"),
    [
        ("fp8-block128", None, "emulate"),
        ("fp8-block128", "fp8-token128", "kernel"),
        ("fp8-channel", "fp8-token", "emulate"),
        ("nvfp4", None, "emulate"),
        ("int4-g128", "fp8-tensor", "emulate"),
    ],
)
def test_a_model_holding_codes_computes_what_eager_operands_compute(tiny_moe, weight, act, compute):
    ours = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.bfloat16).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.bfloat16).eval()
    entry = quantize_model(ours, weight, act, DEFAULT_SKIP, compute=compute)
    assert entry["compute"] == compute
    _eager(theirs, weight, act, kernel=compute == "kernel")
    held = dict(ours.named_parameters())
    assert all(held[name].dtype == torch.float8_e4m3fn for name in entry["quantized_modules"])
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits.view(torch.int16), theirs(IDS).logits.view(torch.int16))
