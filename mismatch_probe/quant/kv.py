"""`kv_quant=fp8`: K (after RoPE) and V rounded to e4m3fn with scale 1.0 (clamped to ±448, torch's cast), vLLM's
default fp8 KV cache. The loaded model's attention implementation is replaced by a wrapper, registered under a
name of its own, that rounds the key and value states and calls the original: every attention call reads rounded
entries, the prompt's prefill included, as vLLM V1 reads its paged cache; the query is not rounded. The cache
itself keeps the unrounded states; rounding is idempotent, so reading rounded entries of it is the same as
storing them rounded.

The wrapper's name also gets the original's mask function (transformers' AttentionMaskInterface): transformers
builds no mask at all for an attention name it has no mask function for, and attention then reads every key,
left padding included, which made `generate` (padded per window) and `rescore` (padded per batch) disagree."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from mismatch_probe.quant.formats import e4m3

KV_SCHEMES = ("fp8",)
WRAPPER_PREFIX = "probe-kv-fp8|"


def round_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to e4m3fn with scale 1.0, back in its own dtype (every e4m3 value is exact in bf16 and fp16)."""
    return e4m3(x.float()).to(x.dtype)


def apply_kv_quant(model: torch.nn.Module, scheme: str) -> None:
    """Route `model`'s attention through a wrapper that rounds K and V (`scheme` from KV_SCHEMES)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = model.config._attn_implementation or "eager"
    if inner.startswith(WRAPPER_PREFIX):
        return
    name = WRAPPER_PREFIX + inner

    def rounded_attention(module, query, key, value, *args, **kwargs):
        return _original(ALL_ATTENTION_FUNCTIONS, inner, module)(
            module, query, round_kv_fp8(key), round_kv_fp8(value), *args, **kwargs
        )

    AttentionInterface.register(name, rounded_attention)
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # the original's padding and causal mask, not none at all
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.set_attn_implementation(name)


def _original(functions, inner: str, module: torch.nn.Module) -> Callable:
    """The attention the model ran before: a registered one, or the eager function of the module's own file."""
    if inner != "eager" and inner in functions:
        return functions[inner]
    return sys.modules[type(module).__module__].eager_attention_forward
