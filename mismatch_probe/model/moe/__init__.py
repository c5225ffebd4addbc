"""Per-family MoE routing adapters: shape from the config, routers in the module tree, capture and R3."""

from mismatch_probe.model.moe.base import MoeShape, RouterStyle, RoutingAdapter
from mismatch_probe.model.moe.families import (
    ADAPTERS,
    EXPERT_COUNT_KEYS,
    MODEL_TYPE_ALIASES,
    adapter_chosen,
    adapter_for,
    adapter_named,
    supported_names,
)

__all__ = [
    "ADAPTERS",
    "EXPERT_COUNT_KEYS",
    "MODEL_TYPE_ALIASES",
    "MoeShape",
    "RouterStyle",
    "RoutingAdapter",
    "adapter_chosen",
    "adapter_for",
    "adapter_named",
    "supported_names",
]
