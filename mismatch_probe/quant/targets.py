"""Which parameters of a loaded model a weight scheme quantizes: every linear layer's 2-D weight, each router's
weight (a linear layer even where a family gives it a class of its own), and each fused 3-D expert parameter,
read as one matrix per expert. Embeddings and norms are never among them. `skip` (parameter-name substrings)
keeps some unquantized; the default keeps the routers and lm_head, spelled as SGLang and vLLM spell them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mismatch_probe.model.moe.families import ADAPTERS

ROUTER_CLASSES = frozenset(name for adapter in ADAPTERS for name in adapter.router_classes)
# `mlp.gate.` (Qwen, Mixtral, OLMoE, DeepSeek, GLM, dots1, ERNIE, Hunyuan) and every other router attribute a
# family uses (`.router.`: gpt-oss's `mlp.router`, Llama-4's `feed_forward.router`); then the LM head.
DEFAULT_SKIP: tuple[str, ...] = (
    "mlp.gate.",
    *sorted({f".{adapter.router_attr}." for adapter in ADAPTERS if adapter.router_attr != "gate"}),
    "lm_head",
)
# Fused expert classes stored [E, in, out] that do not say so with transformers' `is_transposed`.
TRANSPOSED_EXPERTS = frozenset({"Llama4TextExperts"})


@dataclass(frozen=True)
class Target:
    """One quantizable parameter: `module.<attr>`, named `name` in the model."""

    name: str
    module: torch.nn.Module
    attr: str
    experts: bool = False  # a fused [E, ...] parameter, one matrix per expert
    transposed: bool = False  # experts stored [E, in, out] (used as x @ W[e])
    gate_up: str | None = None  # a fused gate and up projection: "concatenated" or "interleaved"

    @property
    def parameter(self) -> torch.nn.Parameter:
        return getattr(self.module, self.attr)


def parse_skip(text: str | None) -> tuple[str, ...]:
    """`weight_quant_skip=`: None or "default" for the default list, "" for none, else comma-separated."""
    if text is None or text.strip() == "default":
        return DEFAULT_SKIP
    return tuple(part.strip() for part in text.split(",") if part.strip())


def find_targets(model: torch.nn.Module) -> list[Target]:
    """Every linear or expert weight of `model`, in module order."""
    targets: list[Target] = []
    for prefix, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            continue
        dot = f"{prefix}." if prefix else ""
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ in ROUTER_CLASSES
        for attr, param in module.named_parameters(recurse=False):
            if linear and attr == "weight" and param.dim() == 2:
                targets.append(Target(name=f"{dot}{attr}", module=module, attr=attr))
            elif param.dim() == 3 and not attr.endswith("bias"):
                targets.append(_experts(f"{dot}{attr}", module, attr))
    return targets


def _experts(name: str, module: torch.nn.Module, attr: str) -> Target:
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:
        transposed = type(module).__name__ in TRANSPOSED_EXPERTS
    layout = "concatenated" if getattr(module, "is_concatenated", True) else "interleaved"
    return Target(
        name=name,
        module=module,
        attr=attr,
        experts=True,
        transposed=bool(transposed),
        gate_up=layout if "gate_up" in attr else None,
    )


def split_targets(targets: list[Target], skip: tuple[str, ...]) -> tuple[list[Target], list[Target]]:
    """(quantized, skipped): a target is skipped when its name contains any of `skip`."""
    skipped = [t for t in targets if any(s in t.name for s in skip)]
    names = {t.name for t in skipped}
    return [t for t in targets if t.name not in names], skipped


def quantized_weight(
    target: Target, scheme: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor | None = None
) -> torch.Tensor:
    """`scheme` applied to the target's weight (or to `source`, the weight in another dtype), one matrix at a
    time, in its stored layout; the result in the dtype `scheme` returns."""
    w = target.parameter.detach() if source is None else source
    if not target.experts:
        return scheme(w)
    matrices = w.transpose(-1, -2) if target.transposed else w  # [E, out, in]
    if target.gate_up is None:
        out = scheme(matrices)
    else:
        rows = matrices.shape[-2]
        halves = (slice(0, rows // 2), slice(rows // 2, rows))
        if target.gate_up == "interleaved":
            halves = (slice(0, rows, 2), slice(1, rows, 2))
        parts = [scheme(matrices[:, half]) for half in halves]  # gate, then up: two matrices per expert
        out = torch.empty(matrices.shape, dtype=parts[0].dtype, device=w.device)
        for half, part in zip(halves, parts):
            out[:, half] = part
    return out.transpose(-1, -2) if target.transposed else out
