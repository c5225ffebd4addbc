"""What a routing adapter declares: the MoE shape a config implies, and one router style's arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mismatch_probe.errors import ProbeError


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]


class RouterStyle(Protocol):
    """How one kind of router's forward output is read, and rebuilt for given experts (R3).

    `replay` must compute the gate weights exactly as the router's own forward does, from the
    router's own outputs, so that replaying a model's own choice changes nothing, bit for bit."""

    weights_at: int  # where the gate weights sit in the router's output (the MoE block weights its experts by them)

    def chosen(self, router: torch.nn.Module, output: Any) -> torch.Tensor:
        """`[tokens, top_k]` expert ids this router call picked."""

    def replay(self, router: torch.nn.Module, output: Any, experts: torch.Tensor) -> Any:
        """The router's output as it would be had it picked `experts`."""

    def selection_scores(self, router: torch.nn.Module, output: Any) -> torch.Tensor:
        """`[tokens, experts]` float32: the scores the router ranks experts by for its top-k."""


@dataclass(frozen=True)
class RoutingAdapter:
    family: str  # the name users know the family by
    model_types: tuple[str, ...]  # config model_type values (a text_config's included)
    block_classes: tuple[str, ...]  # class names of the MoE blocks in transformers (they hold the router)
    router_classes: tuple[str, ...]  # class names of the router modules in transformers
    style: RouterStyle
    num_experts_key: str  # the config.json keys, as the family spells them
    top_k_key: str
    moe_layers: Callable[[Any, int], tuple[int, ...]]  # (text config, num_hidden_layers) -> MoE layer ids
    router_attr: str = "gate"  # the block's attribute that holds its router
    megatron: bool = False  # the megatron engine builds this family
    megatron_r3: bool = False  # ... and replays its routing
    # The first transformers release whose routers of this family the style reads, where that is newer than the
    # floor pyproject.toml declares: before it they return another tuple (or the logits alone).
    min_transformers: str | None = None

    def shape(self, config: Any) -> MoeShape:
        n_layers = int(config.num_hidden_layers)
        num_experts = _uniform(config, self.num_experts_key)
        top_k = _uniform(config, self.top_k_key)
        if not num_experts or not top_k:
            return MoeShape(num_experts=0, top_k=0, moe_layers=())
        return MoeShape(num_experts=num_experts, top_k=top_k, moe_layers=tuple(self.moe_layers(config, n_layers)))


def _uniform(config: Any, key: str) -> int:
    """A per-layer list (Hunyuan allows one) is accepted only when every layer agrees."""
    value = getattr(config, key, None)
    if isinstance(value, (list, tuple)):
        if len(set(value)) > 1:
            raise ProbeError(f"'{key}' differs between layers ({list(value)}); expected one value")
        value = value[0] if value else None
    return int(value or 0)
