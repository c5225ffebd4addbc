"""The `hf` training pass matched to a rollout's quantization: the `--engine-arg` values that make a training pass
see the rollout's weights, activations and KV cache as its engine rounded them. Torch-free: `probe report`,
`probe env RUN` and `probe diagnose` read it without loading a model.

An `hf` rollout's manifest names `hf` schemes already (its module lists are lists): they pass through. An SGLang
or vLLM rollout's names the server's `--quantization` and `--kv-cache-dtype` (its module lists are null,
engines/serving/quantization.py); they map as follows (docs/production-rollouts.md, "Served rollouts"):

- `fp8` on an FP8 checkpoint (config.json `quantization_config.quant_method == "fp8"`, 128x128 block scales or
  per-tensor ones): `weight_quant=checkpoint:MODEL`, the checkpoint's own codes and scales. A training set
  whose weight scheme starts with `checkpoint:` is matched to it, whatever the path (the rollout's model may
  sit elsewhere) and whatever activation scheme the checkpoint pass recorded.
- `fp8` on a bf16/fp16 checkpoint (online quantization at load): `weight_quant=fp8-tensor act_quant=fp8-tensor`,
  per-tensor weight scales and one dynamic activation scale per call. vLLM's
  model_executor/layers/quantization/fp8.py (Fp8LinearMethod.process_weights_after_loading: `scaled_fp8_quant(
  layer.weight, scale=None)`, one scale per weight) and SGLang's srt/layers/quantization/fp8.py
  (`input_to_float8`, tensor-wise) do that where their GPU has no CUTLASS fp8 GEMM; on one that has (SM89+), vLLM
  scales activations per token, and SGLang weights per output channel (`per_token_group_quant_fp8` over the
  whole row) and activations per token (fp8_utils.apply_fp8_linear). No `hf` activation scheme is per token
  over the whole row yet, so the per-tensor pair is the nearest pass, not an exact one.
- a KV cache of `fp8` or `fp8_e4m3`: `kv_quant=fp8` (scale 1.0, e4m3).
- anything else (`mxfp8`, `modelopt_fp4`/`nvfp4`, `awq`, `gptq`, `fp8_e5m2` KV, an `fp8` rollout whose model
  folder cannot be read): no matched pass (None).
"""

from __future__ import annotations

import json
from pathlib import Path

CHECKPOINT = "checkpoint:"  # weight_quant=checkpoint:PATH: codes and scales read from an FP8 checkpoint
# weight_quant=dequantized: an FP8 checkpoint's weights loaded as plain weights, its products unquantized: the
# plain pass of a rollout served from an FP8 checkpoint where no bf16 original is at hand
DEQUANTIZED = "dequantized"
ONLINE = {"fp8": {"weight_quant": "fp8-tensor", "act_quant": "fp8-tensor"}}  # served scheme on a bf16 checkpoint
SERVED_KV = {"fp8": "fp8", "fp8_e4m3": "fp8"}  # a server's kv_cache_dtype -> kv_quant


def matched_quant_args(quantization: dict | None, model: str | Path | None) -> dict[str, str] | None:
    """The hf engine's --engine-arg values (keys among weight_quant, act_quant, kv_quant) of the training pass
    matched to a rollout whose manifest records `quantization`; None when the rollout is not quantized or has no
    known matched pass."""
    if not isinstance(quantization, dict):
        return None
    weight, act, kv = (quantization.get(key) for key in ("weight", "act", "kv"))
    if weight is None and act is None and kv is None:
        return None
    if _served(quantization):
        return _served_args(str(weight) if weight else None, act, str(kv) if kv else None, model)
    named = {"weight_quant": weight, "act_quant": act, "kv_quant": kv}
    return {key: str(value) for key, value in named.items() if value}


def matched_pair(quantization: dict | None, model: str | Path | None) -> tuple | None:
    """(weight, act) a training set's quantization must have to be the rollout's matched pass; None when none is
    known or the rollout quantizes neither."""
    args = matched_quant_args(quantization, model) or {}
    pair = (args.get("weight_quant"), args.get("act_quant"))
    return None if pair == (None, None) else pair


def is_matched(training: tuple | None, target: tuple | None) -> bool:
    """A training set's (weight, act) against `matched_pair`: equal, or both read from an FP8 checkpoint."""
    if training is None or target is None:
        return False
    if str(target[0] or "").startswith(CHECKPOINT):
        return str(training[0] or "").startswith(CHECKPOINT)
    return training == target


def plain_args(model: str | Path | None) -> dict[str, str]:
    """The --engine-arg values of an unquantized hf pass over `model`: none, or weight_quant=dequantized where
    the model folder is an FP8 checkpoint (which would otherwise load quantized by its own scales)."""
    return {"weight_quant": DEQUANTIZED} if checkpoint_layout(model) in ("block", "tensor") else {}


def engine_args_text(args: dict[str, str]) -> str:
    """` --engine-arg weight_quant=fp8-tensor --engine-arg act_quant=fp8-tensor`."""
    return "".join(f" --engine-arg {key}={value}" for key, value in args.items())


def no_pass_reason(quantization: dict | None) -> str:
    """Why a quantized rollout has no matched pass, for the report's missing line and `probe env RUN`."""
    q = quantization if isinstance(quantization, dict) else {}
    said = ", ".join(f"{key} {q[key]}" for key in ("weight", "act", "kv") if q.get(key))
    return (
        f"no matched hf training pass is known for the served quantization ({said}): docs/production-rollouts.md, "
        "Served rollouts"
    )


def checkpoint_quantization(model: str | Path | None) -> dict | None:
    """The model folder's config.json `quantization_config` ({} where it has none); None where config.json
    cannot be read."""
    try:
        config = json.loads((Path(str(model)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) else {}


def checkpoint_layout(model: str | Path | None) -> str | None:
    """`block` or `tensor` for an FP8 checkpoint's weight scales (quant_method fp8, with or without
    weight_block_size), `none` for a checkpoint without quantization_config, `other` for one quantized otherwise;
    None where config.json cannot be read."""
    qc = checkpoint_quantization(model)
    if qc is None:
        return None
    if not qc:
        return "none"
    if qc.get("quant_method") != "fp8":
        return "other"
    return "block" if qc.get("weight_block_size") else "tensor"


def _served(quantization: dict) -> bool:
    """A server's entry: its module lists are unknown (null), where an hf side's are read from the model."""
    return quantization.get("quantized_modules") is None and quantization.get("skipped_modules") is None


def _served_args(weight: str | None, act, kv: str | None, model) -> dict[str, str] | None:
    args: dict[str, str] = {}
    if act is not None:  # a server names no activation scheme of its own
        return None
    if weight is not None:
        layout = checkpoint_layout(model)
        if weight.lower() == "fp8" and layout in ("block", "tensor"):
            args["weight_quant"] = f"{CHECKPOINT}{model}"
        elif weight.lower() in ONLINE and layout == "none":
            args.update(ONLINE[weight.lower()])
        else:
            return None
    if kv is not None:
        if kv.lower() not in SERVED_KV:
            return None
        args["kv_quant"] = SERVED_KV[kv.lower()]
    return args
