"""`--engine-arg weight_quant=`, `weight_quant_skip=`, `act_quant=` and `kv_quant=` of the `hf` engines: fake quantization of
the loaded model as a quantized production rollout runs it (mismatch_probe/quant/, docs/production-rollouts.md).
The values are checked when the options are built, before the run folder is touched or the model loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mismatch_probe.engines.options import option
from mismatch_probe.errors import ProbeError
from mismatch_probe.quant.apply import quantize_model
from mismatch_probe.quant.kv import KV_SCHEMES
from mismatch_probe.quant.schemes import ACT_SCHEMES, WEIGHT_SCHEMES
from mismatch_probe.quant.targets import DEFAULT_SKIP, parse_skip


@dataclass(frozen=True)
class QuantOptions:
    """Fake quantization of the loaded weights and of the quantized linears' inputs."""

    weight_quant: str | None = option(
        None, f"{', '.join(WEIGHT_SCHEMES)}: fake-quantize every linear and expert weight (none: off)"
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

    def check_quant(self) -> None:
        for key, value, allowed in (
            ("weight_quant", self.weight_quant, WEIGHT_SCHEMES),
            ("act_quant", self.act_quant, ACT_SCHEMES),
            ("kv_quant", self.kv_quant, KV_SCHEMES),
        ):
            if value is not None and value not in allowed:
                raise ProbeError(f"--engine-arg {key}={value}: expected one of none, {', '.join(allowed)}")

    @property
    def quant_skip(self) -> tuple[str, ...]:
        return parse_skip(self.weight_quant_skip)

    def quantize(self, hf: torch.nn.Module) -> dict | None:
        """Quantize `hf` in place; the manifest's `quantization` entry, None when not quantized."""
        return quantize_model(hf, self.weight_quant, self.act_quant, self.quant_skip, self.kv_quant)
