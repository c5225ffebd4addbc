"""Recognising an MoE family from a model's modules, for checkpoints whose model_type names none.

Remote code (a checkpoint's own modeling file) either subclasses a family's transformers classes or copies
them, names and all, into its own module. So a module is taken for a family's MoE block or router when its
class or one of its bases carries one of the family's class names, and then only if its router behaves as
the family's adapter reads it: `router_misfit` runs the router on a few tokens and reads its output with the
adapter, as capture and R3 will."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from mismatch_probe.model.moe.base import MoeShape, RoutingAdapter
from mismatch_probe.model.moe.families import ADAPTERS

PROBE_TOKENS = 5
# Router inputs this small give near-zero logits, so near-uniform expert probabilities: there a router that
# weights its experts otherwise than the adapter (renormalised or not, scaled or not) differs the most.
PROBE_SCALE = 1e-3
_ROUTER_LIKE = re.compile(r"(router|gate)$", re.IGNORECASE)


def router_like_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that look like MoE routers whatever the family: a class named *Router/*Gate, or a
    submodule called `gate`/`router`."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if name and (_ROUTER_LIKE.search(type(module).__name__) or name.rsplit(".", 1)[-1] in ("gate", "router"))
    ]


def class_names(module: torch.nn.Module) -> set[str]:
    """The names of the module's class and of all its bases."""
    return {cls.__name__ for cls in type(module).__mro__}


def named_router(adapter: RoutingAdapter, module: torch.nn.Module) -> tuple[bool, Any]:
    """(whether the family's class names mark `module` as its router or MoE block, the router it is or holds)."""
    names = class_names(module)
    if names & set(adapter.router_classes):
        return True, module
    if names & set(adapter.block_classes):
        return True, getattr(module, adapter.router_attr, None)
    return False, None


def marked_routers(model: torch.nn.Module, adapter: RoutingAdapter) -> list[tuple[str, Any]]:
    """(name, router) of every router the family's class names mark, as a router class or as the router of an
    MoE block (None where such a block has no router attribute)."""
    found: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        is_named, router = named_router(adapter, module)
        if is_named:
            found.setdefault(
                id(router) if router is not None else id(module),
                (name if router is module else f"{name}.{adapter.router_attr}", router),
            )
    return list(found.values())


def router_misfit(adapter: RoutingAdapter, router: Any, hidden_size: int, shape: MoeShape | None) -> str | None:
    """Why `router` does not work as the adapter reads the family's routers, or None when it does: its output
    must give `[tokens, top_k]` expert ids and `[tokens, experts]` selection scores (of `shape`, when given),
    and replaying its own choice must give back its own output (on real weights; a meta model has shapes only)."""
    if not isinstance(router, torch.nn.Module):
        return f"it has no '{adapter.router_attr}' router module"
    weight = next(router.parameters(), None)
    device, dtype = (weight.device, weight.dtype) if weight is not None else (torch.device("cpu"), torch.float32)
    hidden = torch.randn(PROBE_TOKENS, hidden_size, generator=torch.Generator().manual_seed(0)) * PROBE_SCALE
    try:
        with torch.no_grad():
            output = router(hidden.to(device=device, dtype=dtype))
            chosen = adapter.style.chosen(router, output)
            scores = adapter.style.selection_scores(router, output)
            replayed = adapter.style.replay(router, output, chosen)
    except Exception as exc:  # noqa: BLE001 - remote code may raise anything; the reason is reported
        return f"reading it as {adapter.family} fails ({type(exc).__name__}: {_first_line(exc)})"
    if not isinstance(chosen, torch.Tensor) or chosen.is_floating_point() or chosen.dim() != 2:
        return f"its output holds no [tokens, top_k] expert ids where {adapter.family} routers put them"
    top_k, experts = (shape.top_k, shape.num_experts) if shape else (chosen.shape[1], scores.shape[-1])
    if tuple(chosen.shape) != (PROBE_TOKENS, top_k) or tuple(scores.shape) != (PROBE_TOKENS, experts):
        return (
            f"it picks {chosen.shape[1]} of {scores.shape[-1]} experts per token where config.json says "
            f"{top_k} of {experts}"
        )
    if chosen.device.type != "meta" and not bool(((chosen >= 0) & (chosen < experts)).all()):
        return f"its expert ids fall outside 0..{experts - 1}"
    return _replay_differs(output, replayed, adapter.family)


def _replay_differs(output: Any, replayed: Any, family: str) -> str | None:
    own = output if isinstance(output, (tuple, list)) else (output,)
    again = replayed if isinstance(replayed, (tuple, list)) else (replayed,)
    if len(own) != len(again):
        return f"replaying its own choice gives {len(again)} outputs where it gives {len(own)}"
    for i, (a, b) in enumerate(zip(own, again)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        same = a.shape == b.shape and a.dtype == b.dtype
        if same and a.device.type != "meta":
            # Close, not equal: the check is on the arithmetic (which weights), not on rounding.
            same = (
                torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-6)
                if a.is_floating_point()
                else torch.equal(a, b)
            )
        if not same:
            return f"replaying its own choice changes output {i}: it does not weight experts as {family} routers do"
    return None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def family_of_modules(model: torch.nn.Module, config: Any) -> tuple[RoutingAdapter | None, list[str]]:
    """(the first family whose class names mark a module and whose adapter reads that module's router, the
    reasons other name matches were refused). `config` is the text config: hidden size and MoE shape."""
    misfits = []
    for name, module in model.named_modules():
        for adapter in ADAPTERS:
            named, router = named_router(adapter, module)
            if not named:
                continue
            shape = adapter.shape(config)
            reason = (
                router_misfit(adapter, router, int(config.hidden_size), shape)
                if shape.num_experts
                else (f"config.json has no '{adapter.num_experts_key}' and '{adapter.top_k_key}'")
            )
            if reason is None:
                return adapter, []
            misfits.append(f"{name} ({type(module).__name__}) looks like {adapter.family}, but {reason}")
    return None, misfits


def meta_model(config: Any, trust_remote_code: bool) -> torch.nn.Module:
    """The model's module tree without weights (on the meta device): what its modeling code builds, in no
    time and no memory, for recognising its MoE blocks before any weights are read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class Recognition:
    """What a checkpoint's module tree says about its MoE family."""

    adapter: RoutingAdapter | None
    misfits: tuple[str, ...] = ()  # modules the class names matched but whose routers the adapter cannot read
    router_like: str | None = None  # "name: Class" of the first router-like module when no family fits
    failure: str | None = None  # why the module tree could not be built


def recognise_checkpoint(config: Any, trust_remote_code: bool) -> Recognition:
    try:
        model = meta_model(config, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - remote code may raise anything; the reason is reported
        why = f"its modules cannot be built ({type(exc).__name__}: {_first_line(exc)})"
        return Recognition(adapter=None, failure=why)
    adapter, misfits = family_of_modules(model, config.get_text_config())
    if adapter is not None:
        return Recognition(adapter=adapter)
    suspects = router_like_modules(model)
    return Recognition(
        adapter=None,
        misfits=tuple(misfits),
        router_like=f"{suspects[0][0]}: {type(suspects[0][1]).__name__}" if suspects else None,
    )
