"""FP8 checkpoints read without transformers' fp8 quantizer (which needs accelerate, no dependency of probe).

Two layouts, as config.json's `quantization_config` {"quant_method": "fp8", ...} announces them:
- block scaling (DeepSeek-V3, Qwen3-*-FP8): `weight_block_size` [128, 128]; each quantized linear stores
  `X.weight` in float8_e4m3fn and `X.weight_scale_inv` of shape [ceil(out/128), ceil(in/128)];
- per-tensor or per-channel scales (AutoFP8, llm-compressor): `X.weight` in float8_e4m3fn and `X.weight_scale`
  (one value, or one per output row); a static `X.input_scale` is not read (the activations are dynamic).
The dequantized weight is code x scale in float32, per block: exact. A linear stored in another dtype stays
unquantized. A checkpoint loads as its codes (checkpoint_codes.py); `load_dequantized` here, the model built
from the config without its `quantization_config` and loaded from the dequantized float32 state dict through
transformers' own key conversions, is the fallback for a layout that loader does not map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json

PREFIX = "checkpoint:"
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint's config says of its quantization."""

    path: Path
    block: tuple[int, int] | None  # weight_block_size; None for per-tensor or per-channel scales
    dynamic: bool  # activation_scheme "dynamic"

    @property
    def label(self) -> str:
        """The manifest's weight entry, `checkpoint:` and the folder's absolute path: the rollout and its matched
        pass on the same checkpoint record the same, and the report's advice can name it as the option."""
        return f"{PREFIX}{self.path.resolve()}"

    @property
    def scheme(self) -> str:
        """The weight scheme the checkpoint's scales amount to: fp8-block128 (fp8-blockRxC), or fp8-tensor
        for per-tensor and per-channel scales."""
        if self.block is None:
            return "fp8-tensor"
        rows, cols = self.block
        return f"fp8-block{rows}" if rows == cols else f"fp8-block{rows}x{cols}"

    @property
    def act(self) -> str | None:
        """The act scheme of a dynamic checkpoint: per token and 128 channels with block scales, per tensor
        otherwise (vLLM model_executor/layers/quantization/fp8.py `Fp8LinearMethod`)."""
        if not self.dynamic:
            return None
        return "fp8-token128" if self.block is not None else "fp8-tensor"


def read_fp8_checkpoint(path: Path) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 quantization; None when config.json announces none."""
    config = read_json(Path(path) / "config.json")
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2):
        raise ProbeError(
            f"{path}/config.json: quantization_config.weight_block_size: expected [rows, cols], got {block}"
        )
    return Fp8Checkpoint(
        path=Path(path),
        block=tuple(block) if block else None,
        dynamic=q.get("activation_scheme", "dynamic") == "dynamic",
    )


PARTS = ("values", "codes", "scales")


def dequantized_state_dict(checkpoint: Fp8Checkpoint, part: str = "values") -> tuple[dict[str, torch.Tensor], set[str]]:
    """(every tensor of the checkpoint with each fp8 weight replaced by its `part` in float32 — `values`,
    codes x scales; `codes`; `scales`, each element's block scale — and the scales dropped, the names of the
    fp8 weights)."""
    from safetensors.torch import load_file

    files = sorted(checkpoint.path.glob("*.safetensors"))
    if not files:
        raise ProbeError(f"{checkpoint.path}: no *.safetensors files in the FP8 checkpoint")
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        stored.update(load_file(file))
    out, quantized = {}, set()
    for name, tensor in stored.items():
        if name.endswith(("_scale_inv", "_scale")) and name.rsplit("_scale", 1)[0] in stored:
            continue  # a weight's scale, read with it
        if name.endswith(".input_scale") or name.endswith(".activation_scale"):
            continue
        if tensor.dtype == FP8:
            scales = element_scales(name, tensor, stored, checkpoint.block)
            codes = tensor.float()
            out[name] = {"values": codes * scales, "codes": codes, "scales": scales}[part]
            quantized.add(name)
        else:
            out[name] = tensor
    return out, quantized


def element_scales(name: str, codes: torch.Tensor, stored: dict[str, torch.Tensor], block) -> torch.Tensor:
    """The float32 scale of each element's block, shaped as `codes`."""
    rows, cols = codes.shape[-2:]
    if block is not None:
        scale = stored.get(f"{name}_scale_inv")
        if scale is None:
            raise ProbeError(f"checkpoint tensor {name}: float8 weight without {name}_scale_inv")
        br, bc = block
        expected = (math.ceil(rows / br), math.ceil(cols / bc))
        if tuple(scale.shape[-2:]) != expected:
            raise ProbeError(
                f"checkpoint tensor {name}_scale_inv: expected shape {list(expected)}, got {list(scale.shape)}"
            )
        full = scale.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]
    else:
        scale = stored.get(f"{name}_scale")
        if scale is None:
            raise ProbeError(f"checkpoint tensor {name}: float8 weight without {name}_scale")
        scale = scale.float()
        full = scale.reshape(-1, 1) if scale.numel() == rows else scale.reshape(())
    return full.expand(codes.shape).contiguous()


def load_dequantized(checkpoint: Fp8Checkpoint, config, part: str = "values") -> tuple[torch.nn.Module, set[str]]:
    """(the model in float32, its quantized weights holding `part` (dequantized values by default; the
    kernel path loads the codes and the scales the same way, so that each lands in the model's own layout);
    the checkpoint names of its quantized weights)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state, quantized = dequantized_state_dict(checkpoint, part)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        model = cls.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32)
    except (KeyError, OSError, ValueError) as exc:
        raise ProbeError(f"{checkpoint.path}: cannot load the FP8 checkpoint ({str(exc).splitlines()[0]})") from exc
    return model.eval(), quantized


def stored_quantized(parameter_name: str, quantized: set[str]) -> bool:
    """Whether the model parameter `parameter_name` came from fp8 weights of the checkpoint: a linear's
    `X.weight` itself, or a fused expert parameter `P.gate_up_proj` / `P.down_proj` whose per-expert weights
    `P.<e>.*` were stored in fp8."""
    if parameter_name in quantized:
        return True
    prefix = parameter_name.rsplit(".", 1)[0] + "."
    return any(name.startswith(prefix) for name in quantized)
