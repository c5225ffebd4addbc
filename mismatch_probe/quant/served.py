"""The training pass matched to a quantized rollout: the hf engine's `--engine-arg` values that give the training
side the rollout's quantization, from the `quantization` entry its manifest records."""

from __future__ import annotations

from pathlib import Path

# manifest key -> the hf engine's --engine-arg key
_ARGS = (("weight", "weight_quant"), ("act", "act_quant"), ("kv", "kv_quant"))


def matched_quant_args(quantization: dict | None, model: str | Path | None) -> dict[str, str] | None:
    """{weight_quant, act_quant, kv_quant} (those set) of an hf rollout's quantization entry; None when the rollout
    is not quantized or no known training pass matches it. `model` is the rollout's checkpoint."""
    if not isinstance(quantization, dict):
        return None
    args = {key: str(quantization[name]) for name, key in _ARGS if quantization.get(name)}
    return args or None
