"""Quantization applied to a loaded model: each target's weight quantized as stored (a fused expert parameter
one expert and, for gate_up, one half at a time) and written back in the run's dtype (what any reader of the
parameter sees), its float32 operands kept beside it (operands.py), and every product of a quantized module
computed as the kernel does (compute.py), the activation quant inside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.checkpoint import PREFIX, load_dequantized, read_fp8_checkpoint, stored_quantized
from mismatch_probe.quant.checkpoint_codes import CheckpointCodes, CodedWeight, dequantize_codes, load_codes
from mismatch_probe.quant.codes import Codec, codec, decode, element_scales, encode
from mismatch_probe.quant.compute import QuantProducts, kernel_available
from mismatch_probe.quant.kv import apply_kv_quant
from mismatch_probe.quant.operands import MARLIN_SCHEME, Operand, StoredOperand, laid_out_as
from mismatch_probe.quant.schemes import FP8_WEIGHT_BLOCKS
from mismatch_probe.quant.targets import DEFAULT_SKIP, Target, find_targets, quantized_weight, split_targets

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
    dequantize_codes(model, weight)  # a model loaded as FP8 codes, passed plain or quantized otherwise
    if weight is None and act is None and kv is None:
        return None
    if kv is not None:
        apply_kv_quant(model, kv)
    targets = find_targets(model)
    if weight is not None and weight.startswith(PREFIX):
        weight, act, stored, quantized, skipped = _from_checkpoint(
            weight[len(PREFIX) :], act, targets, getattr(model, "fp8_codes", None)
        )
    else:
        quantized, skipped = split_targets(targets, skip) if weight or act else ([], [])
        stored = None
    entry = {"weight": weight, "act": act, "kv": kv}
    if quantized:  # which path computes the quantized products (none with kv_quant alone)
        entry["compute"] = _install(model, quantized, weight, act, compute, stored)
    entry["quantized_modules"] = sorted(t.name for t in quantized)
    entry["skipped_modules"] = sorted(t.name for t in skipped)
    return entry


def _from_checkpoint(path: str, act: str | None, targets: list[Target], coded: CheckpointCodes | None = None):
    """(weight label, act, the checkpoint's parts, quantized, skipped) from the FP8 checkpoint at `path`; its
    parts: {"values": {name: float32 values}, "k_block": ..., "load": the codes and scales, loaded on demand}."""
    from mismatch_probe.model.hf_config import load_hf_config

    checkpoint = read_fp8_checkpoint(path)
    if checkpoint is None:
        raise ProbeError(f"--engine-arg weight_quant={PREFIX}{path}: config.json has no fp8 quantization_config")
    k_block = checkpoint.block[1] if checkpoint.block else WHOLE
    if coded is not None and coded.label == checkpoint.label:  # the model was loaded as this checkpoint's codes
        quantized = [t for t in targets if t.name in coded.weights]
        skipped = [t for t in targets if t.name not in coded.weights]
        return checkpoint.label, act or checkpoint.act, {"coded": coded.weights, "k_block": k_block}, quantized, skipped
    source = load_codes(checkpoint, load_hf_config(path))
    if source is not None:  # another model: each quantized target takes the checkpoint's codes and scales
        params = dict(source.named_parameters())
        missing = sorted(t.name for t in targets if t.name not in params)
        if missing:
            raise ProbeError(f"{path}: the FP8 checkpoint has no parameter {missing[0]} of the model")
        weights = {
            name: replace(weight, codes=params[name].detach() if weight.codes is None else weight.codes)
            for name, weight in source.fp8_codes.weights.items()
        }
        del source, params
        quantized = [t for t in targets if t.name in weights]
        skipped = [t for t in targets if t.name not in weights]
        stored = {"coded": weights, "k_block": k_block, "install": True}
        return checkpoint.label, act or checkpoint.act, stored, quantized, skipped

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
    modules: dict[int, tuple[torch.nn.Module, list[StoredOperand]]] = {}
    parts = stored["load"]() if kernel and stored is not None and "load" in stored else None
    for target in quantized:
        operand = _operand(target, weight, kernel, stored, parts, id(target.parameter) in embeddings, marlin)
        modules.setdefault(id(target.module), (target.module, []))[1].append(operand)
    for module, operands in modules.values():
        mode = QuantProducts(operands, act, kernel)
        module.quant_products = mode  # read by dequantized_weight
        module.register_forward_pre_hook(mode.enter)
        module.register_forward_hook(mode.exit, always_call=True)
    return "kernel" if kernel or marlin else "emulate"


def _operand(
    target: Target, weight: str | None, kernel: bool, stored: dict | None, parts, tied: bool, marlin: bool = False
) -> StoredOperand:
    parameter = target.parameter
    k_block = stored["k_block"] if stored is not None else FP8_WEIGHT_BLOCKS.get(weight, (WHOLE, WHOLE))[1]
    if stored is not None and "coded" in stored:  # an FP8 checkpoint loaded as its codes (checkpoint_codes.py)
        coded = stored["coded"][target.name]
        if stored.get("install"):
            return _install_codes(target, coded, kernel, k_block, tied)
        codes = target.parameter.detach() if coded.codes is None else laid_out_as(parameter, coded.codes)
        return _stored_operand(target, codes, coded.scales, coded.codec, kernel, k_block)
    if stored is not None:  # an FP8 checkpoint's dequantized values, read at load
        dequantized = stored["values"][target.name]
        _write_back(target, dequantized.to(parameter.dtype), tied)
        parameter = target.parameter
        operand = Operand(parameter=parameter, values=laid_out_as(parameter, dequantized), k_block=k_block)
        if kernel and parts is not None:  # the checkpoint's own codes and scales
            codes = laid_out_as(parameter, parts[0][target.name].to(torch.float8_e4m3fn))
            operand = replace(operand, codes=codes, scales=laid_out_as(parameter, parts[1][target.name]))
        return StoredOperand(parameter=parameter, build=lambda: operand)
    if weight is None:  # act_quant alone: the weight as loaded, upcast for each forward
        return StoredOperand(
            parameter=parameter,
            build=lambda: Operand(parameter=parameter, values=laid_out_as(parameter, parameter.detach().float())),
        )
    return _coded(target, codec(weight, parameter.dtype, marlin), kernel, tied, k_block)


def _install_codes(target: Target, coded: CodedWeight, kernel: bool, k_block: int, tied: bool) -> StoredOperand:
    """A checkpoint's codes and scales put into another model's parameter: the codes themselves, or (routers, the
    LM head, a tied head) code x scale in the parameter's dtype, as the float32 load wrote them back."""
    parameter = target.parameter
    if coded.codes.shape != parameter.shape:
        raise ProbeError(
            f"FP8 checkpoint parameter {target.name}: shape {list(coded.codes.shape)}, the model's is "
            f"{list(parameter.shape)}"
        )
    codes = laid_out_as(parameter, coded.codes)
    scales = tuple(s.to(parameter.device) for s in coded.scales)
    if tied or any(name in target.name for name in DEFAULT_SKIP):
        pieces = iter(scales)
        values = quantized_weight(target, lambda c: decode(c, next(pieces), coded.codec), source=codes)
        _write_back(target, values.to(parameter.dtype), tied)
    else:
        parameter.data = codes
        codes = parameter.detach()
    return _stored_operand(target, codes, scales, coded.codec, kernel, k_block)


def _coded(target: Target, scheme: Codec, kernel: bool, tied: bool, k_block: int) -> StoredOperand:
    """The weight kept as its e4m3fn codes and block scales (codes.py), one matrix (or gate/up half) at a time
    as `quantized_weight` cuts it. The parameter itself holds the codes, in its own layout, where nothing but the
    quantized products reads it; the routers and the LM head (which the fp32 knobs copy and the router check
    calls outside its quantized forward) and a head tied to the embeddings hold the dequantized weight in the
    run's dtype as before, the codes beside it."""
    scales: list[torch.Tensor] = []

    def split(w: torch.Tensor) -> torch.Tensor:
        # a matrix at a time: the float32 intermediates of one expert's matrix, not of the whole fused parameter
        # (no block spans two matrices, so the codes and scales are those of the whole batch at once)
        parts = [encode(m, scheme) for m in w] if w.dim() == 3 else [encode(w, scheme)]
        scales.append(torch.stack([s for _, s in parts]) if w.dim() == 3 else parts[0][1])
        return torch.stack([c for c, _ in parts]) if w.dim() == 3 else parts[0][0]

    raw = quantized_weight(target, split, source=target.parameter.detach())  # encode upcasts, exactly

    def values(of: torch.Tensor) -> torch.Tensor:
        pieces = iter(scales)  # in the order `quantized_weight` cut the matrices when encoding
        return quantized_weight(target, lambda c: decode(c, next(pieces), scheme), source=of)

    dtype = target.parameter.dtype
    if tied or any(name in target.name for name in DEFAULT_SKIP):
        _write_back(target, values(raw).to(dtype), tied)
    codes = laid_out_as(target.parameter, raw)
    del raw
    if not (tied or any(name in target.name for name in DEFAULT_SKIP)):
        target.parameter.data = codes  # the model's one copy of this weight
    return _stored_operand(target, codes, scales, scheme, kernel, k_block)


def _stored_operand(target: Target, codes: torch.Tensor, scales, scheme: Codec, kernel: bool, k_block: int):
    """The StoredOperand of `codes` (e4m3fn, the parameter's layout) and their block `scales`, one per matrix
    batch in the order `quantized_weight` cuts them: its float32 operands built per forward."""
    parameter = target.parameter

    def build() -> Operand:
        pieces = iter(scales)
        values = quantized_weight(target, lambda c: decode(c, next(pieces), scheme), source=codes)
        operand = Operand(parameter=parameter, values=laid_out_as(parameter, values), k_block=k_block)
        if not kernel:
            return operand
        pieces = iter(scales)
        every = quantized_weight(target, lambda c: element_scales(c, next(pieces), scheme), source=codes)
        return replace(operand, codes=codes, scales=laid_out_as(parameter, every))

    return StoredOperand(parameter=parameter, build=build)


def dequantized_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The float32 dequantized weight a quantized parameter `name` of `model` multiplies with (codes x scales,
    in the parameter's layout), built as its products build it."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    parameter = getattr(module, attr)
    stored = next(o for o in module.quant_products.operands if o.parameter is parameter)
    return stored.build().values


def _write_back(target: Target, q: torch.Tensor, tied: bool) -> None:
    if tied:  # an LM head tied to the embeddings: the embeddings keep their weights
        setattr(target.module, target.attr, torch.nn.Parameter(q, requires_grad=False))
    else:
        target.parameter.data.copy_(q)
