"""`--engine-arg weight_quant=`, `weight_quant_skip=`, `act_quant=`, `kv_quant=` and `quant_compute=` of the `hf`
engines: quantization of the loaded model as a quantized production rollout runs it (mismatch_probe/quant/,
docs/production-rollouts.md). The values are checked when the options are built, before the run folder is
touched or the model loaded; a model folder that is an FP8 checkpoint is quantized by its own codes and scales."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe.engines.options import option
from mismatch_probe.errors import ProbeError
from mismatch_probe.quant.apply import quantize_model
from mismatch_probe.quant.checkpoint import PREFIX, read_fp8_checkpoint
from mismatch_probe.quant.compute import COMPUTE
from mismatch_probe.quant.kv import KV_SCHEMES
from mismatch_probe.quant.operands import MARLIN_SCHEME
from mismatch_probe.quant.schemes import ACT_SCHEMES, FP8_WEIGHT_BLOCKS, WEIGHT_SCHEMES
from mismatch_probe.quant.served import DEQUANTIZED
from mismatch_probe.quant.targets import DEFAULT_SKIP, parse_skip


@dataclass(frozen=True)
class QuantOptions:
    """Quantization of the loaded weights and of the quantized linears' inputs, and how their products compute."""

    weight_quant: str | None = option(
        None,
        f"{', '.join(WEIGHT_SCHEMES)}: quantize every linear and expert weight; {PREFIX}PATH: the codes and "
        "scales of the FP8 checkpoint at PATH; {DEQUANTIZED}: a model that is an FP8 checkpoint loaded as plain "
        "weights (codes x scales in the run's dtype), unquantized products (none: off; an FP8 checkpoint then "
        "quantizes by its own scales)",
    )
    weight_quant_skip: str = option(
        "default",
        f"comma-separated parameter-name substrings kept unquantized; default: {','.join(DEFAULT_SKIP)} "
        "(the routers and lm_head); empty: quantize those too",
    )
    act_quant: str | None = option(
        None, f"{', '.join(ACT_SCHEMES)}: dynamic fp8 of each quantized linear's input (none: off)"
    )
    kv_quant: str | None = option(
        None,
        f"{', '.join(KV_SCHEMES)}: K (after RoPE) and V rounded to e4m3fn with scale 1.0 before every attention, "
        "the prefill's included (vLLM's default fp8 KV cache; none: off)",
    )
    quant_compute: str = option(
        "auto",
        "emulate: float32 operands and accumulation, the output cast; kernel: torch._scaled_mm per K chunk (fp8 "
        "weight and act schemes); auto: kernel on CUDA devices with fp8 GEMMs, else emulate",
    )

    def check_quant(self) -> None:
        if self.quant_compute not in COMPUTE:
            raise ProbeError(f"--engine-arg quant_compute={self.quant_compute}: expected one of {', '.join(COMPUTE)}")
        checkpoint = self.weight_quant is not None and self.weight_quant.startswith(PREFIX)
        if checkpoint and read_fp8_checkpoint(Path(self.weight_quant[len(PREFIX) :])) is None:
            raise ProbeError(
                f"--engine-arg weight_quant={self.weight_quant}: config.json has no fp8 quantization_config"
            )
        fp8 = checkpoint or (self.weight_quant in FP8_WEIGHT_BLOCKS and self.act_quant in ACT_SCHEMES)
        if self.quant_compute == "kernel" and not fp8 and self.weight_quant != MARLIN_SCHEME:
            raise ProbeError(
                "--engine-arg quant_compute=kernel: the kernel path needs an fp8 weight_quant "
                f"({', '.join(FP8_WEIGHT_BLOCKS)}) and an act_quant, or {MARLIN_SCHEME} (Marlin's arithmetic)"
            )
        plain = checkpoint or self.weight_quant == DEQUANTIZED
        for key, value, allowed in (
            ("weight_quant", None if plain else self.weight_quant, WEIGHT_SCHEMES),
            ("act_quant", self.act_quant, ACT_SCHEMES),
            ("kv_quant", self.kv_quant, KV_SCHEMES),
        ):
            if value is not None and value not in allowed:
                raise ProbeError(f"--engine-arg {key}={value}: expected one of none, {', '.join(allowed)}")

    @property
    def quant_skip(self) -> tuple[str, ...]:
        return parse_skip(self.weight_quant_skip)

    def quantize(self, hf: torch.nn.Module, model_path: Path | None = None) -> dict | None:
        """Quantize `hf` in place; the manifest's `quantization` entry, None when not quantized. A model loaded
        from an FP8 checkpoint (`model_path`) is quantized by it unless `weight_quant` names a scheme."""
        weight = self.weight_quant
        if weight == DEQUANTIZED:  # the FP8 checkpoint's weights as plain weights: the unquantized pass
            weight = None
        elif weight is None and model_path is not None and read_fp8_checkpoint(Path(model_path)) is not None:
            weight = f"{PREFIX}{model_path}"
        return quantize_model(hf, weight, self.act_quant, self.quant_skip, self.kv_quant, self.quant_compute)
