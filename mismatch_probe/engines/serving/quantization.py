"""The manifest's `quantization` entry of an SGLang or vLLM rollout, from the settings the engine reports.

A server names its weight scheme (`--quantization fp8`, `modelopt_fp4`, ...) and its KV-cache dtype
(`--kv-cache-dtype fp8_e4m3`; `auto` is the model's dtype, no quantization); it does not say which modules
the scheme reaches, nor how it quantizes activations, so those stay null (unknown), unlike an `hf` side's
lists read from the loaded model (mismatch_probe/quant/). A server that names no scheme runs the checkpoint's
own: SGLang reports `quantization: null` for an FP8 checkpoint started without `--quantization` (its
ModelConfig._verify_quantization, sglang/srt/configs/model_config.py, resolves the checkpoint's quant_method,
not its ServerArgs), so the model folder's config.json names it then.
"""

from __future__ import annotations

from mismatch_probe.quant.served import checkpoint_quantization

UNQUANTIZED_KV = ("", "auto", "none")  # the KV cache in the model's own dtype


def weight_scheme(value) -> str | None:
    """A server's `quantization` setting: its scheme's name, None where it has none."""
    text = "" if value is None else str(value).strip()
    return None if text.lower() in ("", "none") else text


def kv_scheme(value) -> str | None:
    """A server's `kv_cache_dtype`: None where the cache keeps the model's dtype (`auto`)."""
    text = "" if value is None else str(value).strip()
    return None if text.lower() in UNQUANTIZED_KV else text


def served_quantization(weight, kv_cache_dtype, model_path=None) -> dict | None:
    """{weight, act, kv, quantized_modules, skipped_modules} from a server's `quantization` and `kv_cache_dtype`
    settings, the weight scheme else the checkpoint's own at `model_path` (its quantization_config's
    quant_method); None where neither quantizes."""
    weight, kv = weight_scheme(weight), kv_scheme(kv_cache_dtype)
    if weight is None and model_path is not None:
        weight = weight_scheme((checkpoint_quantization(model_path) or {}).get("quant_method"))
    if weight is None and kv is None:
        return None
    return {"weight": weight, "act": None, "kv": kv, "quantized_modules": None, "skipped_modules": None}
