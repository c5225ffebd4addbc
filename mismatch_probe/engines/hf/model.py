"""Loading a transformers causal LM in one of the engine dtypes, on the device its options name."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from mismatch_probe.engines.hf.device import DeviceOptions
from mismatch_probe.engines.hf.upcast import compute_in_float32, stored_half_dtype
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.generation import checkpoint_generation_config
from mismatch_probe.model.hf_config import load_hf_config
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.quant.checkpoint import PREFIX, load_dequantized, read_fp8_checkpoint
from mismatch_probe.quant.checkpoint_codes import Unmapped, cast_floating, load_half, stored_layout, to_codes
from mismatch_probe.vocab import DTYPES, FP32, FP32_BF16W, WEIGHT_TORCH


def load_hf_model(model: ModelInfo, dtype: str, placement: DeviceOptions | None = None) -> torch.nn.Module:
    """The model in eval mode; on the CPU without `placement`."""
    if dtype not in DTYPES:
        raise ProbeError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    placement = placement or DeviceOptions(device="cpu")
    hf_logging.disable_progress_bar()  # our own progress bars are the ones that matter
    config = load_hf_config(model.path, model.trust_remote_code)
    spread = {"device_map": placement.device_map} if placement.device_map else {}
    checkpoint = read_fp8_checkpoint(model.path)
    if checkpoint is not None:  # read without transformers' fp8 quantizer; quantized later by its own scales
        return _with_generation_config(_load_fp8(model, checkpoint, config, dtype, placement), model).eval()
    stored = _stored_dtype(model, dtype)
    upcast_later = getattr(placement, "weight_quant", None) is not None
    if upcast_later:  # quantization writes the dequantized weights back in the parameters' dtype: fp32 ones
        stored = getattr(torch, WEIGHT_TORCH[dtype])
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            model.path,
            config=config,
            dtype=stored,
            trust_remote_code=model.trust_remote_code,
            **spread,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"{model.path}: cannot load model ({str(exc).splitlines()[0]})") from exc
    if not spread:
        hf = hf.to(placement.torch_device())
    if dtype == FP32_BF16W and upcast_later:  # loaded in bf16, which rounded the weights; computes in fp32
        hf = hf.float()
    elif dtype in (FP32, FP32_BF16W) and stored != torch.float32:  # half-precision weights computing in fp32
        hf = compute_in_float32(hf)
    return _with_generation_config(hf, model).eval()


def _load_fp8(model: ModelInfo, checkpoint, config, dtype: str, placement) -> torch.nn.Module:
    """An FP8 checkpoint as its codes (checkpoint_codes.py): the fp8 weights as e4m3 codes where its own
    quantization follows (no weight_quant, or weight_quant=checkpoint: of this folder), else dequantized in the
    pass's dtype, a parameter at a time; the dequantized float32 state dict where its layout is not mapped."""
    weight = getattr(placement, "weight_quant", None)
    keep = weight is None or (
        weight.startswith(PREFIX) and Path(weight[len(PREFIX) :]).resolve() == checkpoint.path.resolve()
    )
    weight_dtype = getattr(torch, WEIGHT_TORCH[dtype])
    fp8, others = stored_layout(checkpoint)
    # a half dtype holds every e4m3 code exactly; an fp32 pass loads in bf16 only where nothing else is fp32
    half = weight_dtype if weight_dtype != torch.float32 else torch.bfloat16
    load_dtype = half if others <= {"BF16"} or weight_dtype != torch.float32 else torch.float32
    spread = {"device_map": placement.device_map} if placement.device_map else {}
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    try:
        hf = load_half(checkpoint, config, load_dtype, trust_remote_code=model.trust_remote_code, **spread)
        # a quantized pass's routers and head (read outside its products) hold code x scale in the parameters'
        # final dtype, as the quantizer writes them back (fp32 for fp32-bf16w)
        values = torch.float32 if keep and dtype == FP32_BF16W else weight_dtype
        hf = to_codes(hf, checkpoint, fp8, weight_dtype, keep, values_dtype=values)
    except Unmapped:
        hf, _ = load_dequantized(checkpoint, config)
        hf = hf.to(weight_dtype)
        spread = {}
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"{model.path}: cannot load the FP8 checkpoint ({str(exc).splitlines()[0]})") from exc
    if not spread:
        hf = hf.to(placement.torch_device())
    if dtype == FP32_BF16W:  # the weights as a bf16 pass holds them, computing in fp32
        cast_floating(hf, torch.float32, keep=_codes(hf))
    return hf


def _codes(hf: torch.nn.Module) -> set[int]:
    return {id(p) for p in hf.parameters() if p.dtype == torch.float8_e4m3fn}


def _stored_dtype(model: ModelInfo, dtype: str) -> torch.dtype:
    """The dtype the parameters are loaded in: the run's, but an fp32 run keeps a checkpoint stored wholly in bf16
    (or fp16) as stored, computing in fp32 a module at a time (upcast.py); fp32-bf16w loads bf16 (rounding the
    weights) and computes likewise."""
    if dtype == FP32:
        return stored_half_dtype(model.path) or torch.float32
    return getattr(torch, WEIGHT_TORCH[dtype])


def _with_generation_config(hf: torch.nn.Module, model: ModelInfo) -> torch.nn.Module:
    """The checkpoint's generation config (end ids, pad id), read in one place whatever the load path: a model
    built from a state dict (FP8 checkpoints) would otherwise have only config.json's ids."""
    hf.generation_config = checkpoint_generation_config(model.path, hf.config)
    return hf
