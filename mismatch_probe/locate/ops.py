"""The operations of a transformers decoder that locate measures, found by the attribute names transformers
uses. An operation is a branch of the layer with its own pre-norm, so that a fault in a norm's weights lands
in the operation it feeds:

- attention: input_layernorm then self_attn, from the residual stream entering the layer to the attention
  output (before the residual add);
- router: the MoE router, from the hidden states it is given to the experts it chooses;
- mlp: post_attention_layernorm (pre_feedforward_layernorm where the model has one) then the MLP or MoE
  block, from the residual stream after attention to the block's output;
- block: the whole decoder layer, residual stream in and out (a summary row, never located);
- final_norm: the decoder's last norm; logits: the LM head on the final norm's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo

ATTENTION, ROUTER, MLP, BLOCK, FINAL_NORM, LOGITS = "attention", "router", "mlp", "block", "final_norm", "logits"
OPS = (ATTENTION, ROUTER, MLP, BLOCK, FINAL_NORM, LOGITS)
LAYER_OPS = (ATTENTION, ROUTER, MLP, BLOCK)
_ATTENTION_NAMES = ("self_attn", "linear_attn", "attention", "attn")  # linear_attn: Qwen3-Next's GatedDeltaNet
_MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
_ATTENTION_NORMS = ("input_layernorm",)
_MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm")


@dataclass
class LayerOps:
    index: int
    layer: torch.nn.Module
    attention_norm: torch.nn.Module | None
    attention: torch.nn.Module
    mlp_norm: torch.nn.Module | None
    mlp: torch.nn.Module
    router: torch.nn.Module | None  # None in a dense layer


@dataclass
class ModelOps:
    decoder: torch.nn.Module  # returns the final norm's output as last_hidden_state
    layers: list[LayerOps]
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    reduction: dict[str, int]  # per op, the longest dot product it computes (for the float32 floor)


def _first(module: torch.nn.Module, names: tuple[str, ...], what: str, required: bool = True):
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    if required:
        raise ProbeError(
            f"probe locate: a decoder layer ({type(module).__name__}) has no {what} module ({', '.join(names)})"
        )
    return None


def _decoder(hf: torch.nn.Module) -> torch.nn.Module | None:
    """The module holding `.layers` and `.norm`: get_decoder()'s answer, or below it (Llama-4's get_decoder()
    returns the whole causal LM), or the causal LM's `.model`."""
    found = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    for candidate in (found, getattr(found, "model", None), getattr(hf, "model", None)):
        if hasattr(candidate, "layers") and hasattr(candidate, "norm"):
            return candidate
    return found


def model_ops(hf: torch.nn.Module, info: ModelInfo, routers: list[torch.nn.Module]) -> ModelOps:
    decoder = _decoder(hf)
    layers = getattr(decoder, "layers", None)
    final_norm = getattr(decoder, "norm", None)
    lm_head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if layers is None or final_norm is None or lm_head is None:
        raise ProbeError(
            f"{info.path}: probe locate reads decoders with .layers, .norm and an LM head; '{info.architecture}' has not all three"
        )
    by_layer = dict(zip(info.moe_layer_indices, routers))
    ops = [
        LayerOps(
            index=i,
            layer=layer,
            attention_norm=_first(layer, _ATTENTION_NORMS, "attention norm", required=False),
            attention=_first(layer, _ATTENTION_NAMES, "attention"),
            mlp_norm=_first(layer, _MLP_NORMS, "MLP norm", required=False),
            mlp=_first(layer, _MLP_NAMES, "MLP"),
            router=by_layer.get(i),
        )
        for i, layer in enumerate(layers)
    ]
    return ModelOps(decoder=decoder, layers=ops, final_norm=final_norm, lm_head=lm_head, reduction=_reduction(hf))


def _reduction(hf: torch.nn.Module) -> dict[str, int]:
    config = hf.config.get_text_config()
    hidden = int(config.hidden_size)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    ffn = max(int(getattr(config, key, 0) or 0) for key in ("intermediate_size", "moe_intermediate_size"))
    attention = max(hidden, heads * head_dim)
    mlp = max(hidden, ffn)
    return {
        ATTENTION: attention,
        ROUTER: hidden,
        MLP: mlp,
        BLOCK: max(attention, mlp),
        FINAL_NORM: hidden,
        LOGITS: hidden,
    }
