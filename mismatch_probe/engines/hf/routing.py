"""Forward hooks on transformers MoE routers: capture the experts chosen, or replay given ones (R3).

Which modules are routers, how their output names the chosen experts and how their gate weights
are recomputed for given experts all come from the family's adapter (`mismatch_probe.model.moe`).
Every router call sees hidden states flattened to `[tokens, hidden]`.
"""

from __future__ import annotations

import re
from importlib import metadata

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.moe import MoeShape, RoutingAdapter, adapter_named, supported_names
from mismatch_probe.model.moe.margin import selection_margin
from mismatch_probe.model.moe.recognise import marked_routers, router_like_modules, router_misfit
from mismatch_probe.model.routing_shape import ModelInfo


def _layer_of(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def find_routers(hf: torch.nn.Module, model: ModelInfo) -> list[torch.nn.Module]:
    """The router modules in model-layer order, one per MoE layer of the config: the router-like modules (and
    those the family's class names mark) that work as the family's adapter reads them, checked by running each.
    Refuses a model whose routers no adapter knows, a router the family's names mark that does not work as the
    adapter reads it, and a config that says dense while the model has routers."""
    adapter = adapter_named(model.moe_family)
    suspects = router_like_modules(hf)
    if adapter is None:
        if suspects:
            name, module = suspects[0]
            raise ProbeError(
                f"{model.path}: '{model.architecture}' has router modules ({name}: {type(module).__name__}) but no "
                f"MoE routing adapter for model_type '{model.model_type}'; supported: {supported_names()}; if it "
                f"routes as one of them, name it with --moe-family"
            )
        return []
    _check_transformers(adapter, model)
    marked = marked_routers(hf, adapter)
    named = {id(router) for _, router in marked}
    candidates = marked + [(name, module) for name, module in suspects if id(module) not in named]
    expected = MoeShape(num_experts=model.num_experts, top_k=model.top_k, moe_layers=model.moe_layer_indices)
    hidden = int(hf.config.get_text_config().hidden_size)
    found, misfits = [], []
    for name, module in candidates:
        reason = router_misfit(adapter, module, hidden, expected if model.moe_layer_indices else None)
        if reason is None:
            found.append((_layer_of(name), module))
        elif id(module) in named:  # the family's own class name on a router it cannot read: never guess
            raise ProbeError(
                f"{model.path}: router {name} ({type(module).__name__}) of '{model.architecture}' does not work as "
                f"the {adapter.family} adapter reads it: {reason}"
            )
        else:
            misfits.append((name, module, reason))
    found.sort(key=lambda item: item[0])
    _check_layers(model, adapter, [layer for layer, _ in found], misfits)
    return [module for _, module in found]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def transformers_version() -> str:
    return metadata.version("transformers")


def _check_transformers(adapter: RoutingAdapter, model: ModelInfo) -> None:
    """One line naming the transformers a family's routers need, instead of a misfit further on."""
    need, have = adapter.min_transformers, transformers_version()
    if need is not None and _release(have) < _release(need):
        raise ProbeError(
            f"{model.path}: reading the routers of {adapter.family} models with the hf engine needs transformers >= "
            f"{need} (this environment has {have}): pip install 'transformers>={need}'"
        )


def _check_layers(model: ModelInfo, adapter: RoutingAdapter, layers: list[int], misfits) -> None:
    if not layers and misfits:
        name, module, reason = misfits[0]
        raise ProbeError(
            f"{model.path}: '{model.architecture}' has router modules ({name}: {type(module).__name__}) that the "
            f"{adapter.family} adapter cannot read: {reason}"
        )
    if tuple(layers) == model.moe_layer_indices:
        return
    if not model.moe_layer_indices:
        raise ProbeError(
            f"{model.path}: config.json of '{model.architecture}' says dense (no MoE layers), but the model has "
            f"routers in layers {layers}"
        )
    raise ProbeError(
        f"{model.path}: router modules of '{model.architecture}' sit in layers {layers}, but config.json implies "
        f"MoE layers {list(model.moe_layer_indices)}"
    )


def attach_router_tap(hf: torch.nn.Module, model: ModelInfo) -> RouterTap | None:
    """A tap on an MoE model's routers; None for a dense model (after checking it has no routers)."""
    tap = RouterTap(hf, model)
    return tap if tap.routers else None


class RouterTap:
    """Records every router call per MoE layer, with the margin of its own selection scores; with
    `replay` set, routes to the given experts instead, with gate weights recomputed from the router's
    own outputs as the model computes them (R3). The margin stays the router's own under replay."""

    def __init__(self, hf: torch.nn.Module, model: ModelInfo):
        self.routers = find_routers(hf, model)
        self.style = adapter_named(model.moe_family).style if self.routers else None
        self.family = model.moe_family
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.margins: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.top_k = model.top_k
        self.replay_ids: torch.Tensor | None = None  # [tokens, layers, k]
        self.replay_mask: torch.Tensor | None = None  # [tokens]
        self.read_logprobs = False  # also record the router's log-probs at the chosen (and the old) experts
        self.old_ids: torch.Tensor | None = None  # [tokens, layers, k] the --old set's experts
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.logprobs_at_old: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def reset(self) -> None:
        self.calls = [[] for _ in self.routers]
        self.margins = [[] for _ in self.routers]
        self.logprobs = [[] for _ in self.routers]
        self.logprobs_at_old = [[] for _ in self.routers]
        self.replay_ids = self.replay_mask = self.old_ids = None

    def set_router_logprobs(self, old_ids: torch.Tensor | None) -> None:
        """Record, per call, the router's log-probs at its chosen experts and, given `old_ids`, at those."""
        if not hasattr(self.style, "router_logprobs"):
            raise ProbeError(f"--router-logprobs: the {self.family} router has no softmax over all experts to read")
        self.read_logprobs = True
        self.old_ids = None if old_ids is None else old_ids.long()

    def newest_logprobs(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Each layer's `[tokens, k]` router log-probs of the newest call, at its experts and at the old ones."""
        at_old = [lp[-1] for lp in self.logprobs_at_old] if self.old_ids is not None else None
        return [lp[-1] for lp in self.logprobs], at_old

    def set_replay(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.replay_ids, self.replay_mask = ids.long(), mask.bool()

    def layer_calls(self) -> list[list[torch.Tensor]]:
        return self.calls

    def layer_margins(self) -> list[list[torch.Tensor]]:
        """Per MoE layer, per router call: `[tokens]` float32 selection margins."""
        return self.margins

    def newest_call(self) -> list[torch.Tensor]:
        """The expert ids of every layer's newest call, then their margins: one forward's routing."""
        return [calls[-1] for calls in self.calls] + [margins[-1] for margins in self.margins]

    def replace_newest_call(self, tensors: list[torch.Tensor]) -> None:
        """Put `newest_call()`'s tensors back, as copied to the host: the device keeps no routing past a step."""
        layers = len(self.routers)
        for layer in range(layers):
            self.calls[layer][-1], self.margins[layer][-1] = tensors[layer], tensors[layers + layer]

    def _read_logprobs(self, module, output, layer: int, chosen: torch.Tensor) -> None:
        logprobs = self.style.router_logprobs(module, output).detach()
        self.logprobs[layer].append(logprobs.gather(-1, chosen.long()))
        if self.old_ids is not None:
            self.logprobs_at_old[layer].append(logprobs.gather(-1, self.old_ids[:, layer].to(logprobs.device)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            chosen = self.style.chosen(module, output)
            self.margins[layer].append(selection_margin(self.style.selection_scores(module, output), self.top_k))
            if self.replay_ids is not None:  # moved to the layer's device: under device_map layers differ
                mask, ids = self.replay_mask.to(chosen.device), self.replay_ids[:, layer].to(chosen.device)
                chosen = torch.where(mask[:, None], ids, chosen)
                output = self.style.replay(module, output, chosen)
            self.calls[layer].append(chosen.detach())
            if self.read_logprobs:
                self._read_logprobs(module, output, layer, chosen)
            return output

        return hook
