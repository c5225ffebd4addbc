"""Quantization applied to a loaded model: each target's weight quantized as stored (a fused expert parameter
one expert and, for gate_up, one half at a time) and written back in the run's dtype (what any reader of the
parameter sees), its float32 operands kept beside it (operands.py), and every product of a quantized module
computed as the kernel does (compute.py), the activation quant inside it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.checkpoint import PREFIX, load_dequantized, read_fp8_checkpoint, stored_quantized
from mismatch_probe.quant.compute import QuantProducts, kernel_available
from mismatch_probe.quant.kv import apply_kv_quant
from mismatch_probe.quant.operands import MARLIN_SCHEME, Operand, fp8_parts, laid_out_as, scheme_values
from mismatch_probe.quant.schemes import FP8_WEIGHT_BLOCKS
from mismatch_probe.quant.targets import Target, find_targets, split_targets

Fn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def quantize_model(
    model: torch.nn.Module,
    weight: str | None,
    act: str | None,
    skip: tuple[str, ...],
    kv: str | None = None,
    compute: str = "auto",
) -> dict | None:
    """Quantize `model` in place; the manifest's `quantization` entry, or None when nothing is asked for. With
    only `kv`, no linear is quantized: both module lists are empty. `weight` `checkpoint:PATH` reads the codes
    and scales of an FP8 checkpoint: its quantized linears are quantized (the skip list is the checkpoint's),
    and its dynamic activations get the matching act scheme unless `act` names one."""
    if weight is None and act is None and kv is None:
        return None
    if kv is not None:
        apply_kv_quant(model, kv)
    targets = find_targets(model)
    if weight is not None and weight.startswith(PREFIX):
        weight, act, stored, quantized, skipped = _from_checkpoint(weight[len(PREFIX) :], act, targets)
    else:
        quantized, skipped = split_targets(targets, skip) if weight or act else ([], [])
        stored = None
    entry = {"weight": weight, "act": act, "kv": kv}
    if quantized:  # which path computes the quantized products (none with kv_quant alone)
        entry["compute"] = _install(model, quantized, weight, act, compute, stored)
    entry["quantized_modules"] = sorted(t.name for t in quantized)
    entry["skipped_modules"] = sorted(t.name for t in skipped)
    return entry


def _from_checkpoint(path: str, act: str | None, targets: list[Target]):
    """(weight label, act, the checkpoint's parts, quantized, skipped) from the FP8 checkpoint at `path`; its
    parts: {"values": {name: float32 values}, "k_block": ..., "load": the codes and scales, loaded on demand}."""
    from mismatch_probe.model.hf_config import load_hf_config

    checkpoint = read_fp8_checkpoint(path)
    if checkpoint is None:
        raise ProbeError(f"--engine-arg weight_quant={PREFIX}{path}: config.json has no fp8 quantization_config")

    def part(name: str) -> dict[str, torch.Tensor]:
        model, _ = load_dequantized(checkpoint, load_hf_config(path), name)
        return {n: p.detach().float() for n, p in model.named_parameters()}

    reference, names = load_dequantized(checkpoint, load_hf_config(path))
    values = {n: p.detach().float() for n, p in reference.named_parameters()}
    missing = sorted(t.name for t in targets if t.name not in values)
    if missing:
        raise ProbeError(f"{path}: the FP8 checkpoint has no parameter {missing[0]} of the model")
    quantized = [t for t in targets if stored_quantized(t.name, names)]
    skipped = [t for t in targets if not stored_quantized(t.name, names)]
    k_block = checkpoint.block[1] if checkpoint.block else WHOLE
    stored = {"values": values, "k_block": k_block, "load": lambda: (part("codes"), part("scales"))}
    return checkpoint.label, act or checkpoint.act, stored, quantized, skipped


def _install(model, quantized: list[Target], weight, act, compute: str, stored: dict | None) -> str:
    """Write back each quantized weight, keep its operands, hook each quantized module; "kernel" or "emulate"."""
    device = next(model.parameters()).device
    fp8 = weight in FP8_WEIGHT_BLOCKS or stored is not None
    marlin = compute == "kernel" and weight == MARLIN_SCHEME  # Marlin's w4a16 arithmetic, emulated
    why = kernel_available(device, fp8, act) if compute != "emulate" and not marlin else "emulate asked for"
    if compute == "kernel" and why and not marlin:
        raise ProbeError(f"--engine-arg quant_compute=kernel: {why}")
    kernel = why is None and (compute == "kernel" or device.type == "cuda")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    modules: dict[int, tuple[torch.nn.Module, list[Operand]]] = {}
    parts = stored["load"]() if kernel and stored is not None else None
    for target in quantized:
        operand = _operand(target, weight, kernel, stored, parts, id(target.parameter) in embeddings, marlin)
        modules.setdefault(id(target.module), (target.module, []))[1].append(operand)
    for module, operands in modules.values():
        mode = QuantProducts(operands, act, kernel)
        module.register_forward_pre_hook(mode.enter)
        module.register_forward_hook(mode.exit, always_call=True)
    return "kernel" if kernel or marlin else "emulate"


def _operand(
    target: Target, weight: str | None, kernel: bool, stored: dict | None, parts, tied: bool, marlin: bool = False
) -> Operand:
    source = target.parameter.detach().float()
    if stored is not None:
        dequantized = stored["values"][target.name]
    elif weight is not None:
        dequantized = quantized_weight(target, scheme_values(weight, target.parameter.dtype, marlin), source=source)
    else:
        dequantized = source  # act_quant alone: the weight as loaded
    if weight is not None:
        _write_back(target, dequantized.to(target.parameter.dtype), tied)
    parameter = target.parameter
    codes = scales = None
    k_block = stored["k_block"] if stored is not None else FP8_WEIGHT_BLOCKS.get(weight, (WHOLE, WHOLE))[1]
    if kernel and parts is not None:  # the checkpoint's own codes and scales
        codes = laid_out_as(parameter, parts[0][target.name].to(torch.float8_e4m3fn))
        scales = laid_out_as(parameter, parts[1][target.name])
    elif kernel:
        codes_of, scales_of = fp8_parts(weight)
        codes = laid_out_as(parameter, quantized_weight(target, codes_of, source=source))
        scales = laid_out_as(parameter, quantized_weight(target, scales_of, source=source))
    return Operand(
        parameter=parameter, values=laid_out_as(parameter, dequantized), codes=codes, scales=scales, k_block=k_block
    )


def quantized_weight(target: Target, scheme: Fn, source: torch.Tensor | None = None) -> torch.Tensor:
    """`scheme` applied to the target's weight (or to `source`, the weight in another dtype), one matrix at a
    time, in its stored layout; the result in the dtype `scheme` returns."""
    w = target.parameter.detach() if source is None else source
    if not target.experts:
        return scheme(w)
    matrices = w.transpose(-1, -2) if target.transposed else w  # [E, out, in]
    if target.gate_up is None:
        out = scheme(matrices)
    else:
        rows = matrices.shape[-2]
        halves = (slice(0, rows // 2), slice(rows // 2, rows))
        if target.gate_up == "interleaved":
            halves = (slice(0, rows, 2), slice(1, rows, 2))
        parts = [scheme(matrices[:, half]) for half in halves]  # gate, then up: two matrices per expert
        out = torch.empty(matrices.shape, dtype=parts[0].dtype, device=w.device)
        for half, part in zip(halves, parts):
            out[:, half] = part
    return out.transpose(-1, -2) if target.transposed else out


def _write_back(target: Target, q: torch.Tensor, tied: bool) -> None:
    if tied:  # an LM head tied to the embeddings: the embeddings keep their weights
        setattr(target.module, target.attr, torch.nn.Parameter(q, requires_grad=False))
    else:
        target.parameter.data.copy_(q)
