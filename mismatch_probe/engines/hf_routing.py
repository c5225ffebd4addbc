"""Forward hooks on transformers MoE routers: capture the experts chosen, or replay given ones (R3).

transformers 5 routers (`*TopKRouter`: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) take hidden states
flattened to `[tokens, hidden]` and return `(router_logits, router_scores, router_indices)`.
"""

from __future__ import annotations

import re

import torch

from ..errors import ProbeError
from ..modelinfo import ModelInfo


def find_routers(hf: torch.nn.Module, model: ModelInfo) -> list[torch.nn.Module]:
    """The router modules in model-layer order; one per MoE layer of the manifest."""
    found: list[tuple[int, torch.nn.Module]] = []
    for name, module in hf.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            match = re.search(r"layers\.(\d+)\.", name)
            found.append((int(match.group(1)) if match else len(found), module))
    found.sort(key=lambda item: item[0])
    layers = tuple(i for i, _ in found)
    if layers != model.moe_layer_indices:
        raise ProbeError(
            f"{model.path}: router modules sit in layers {list(layers)}, but config.json implies MoE layers "
            f"{list(model.moe_layer_indices)} (unsupported MoE architecture '{model.architecture}'?)"
        )
    return [module for _, module in found]


class RouterTap:
    """Records every router call per MoE layer; with `replay` set, routes to the given experts instead.

    Replayed gate weights come from the training router's own logits: softmax over all experts,
    gathered at the replayed ids, renormalised when the model renormalises its top-k (R3).
    """

    def __init__(self, hf: torch.nn.Module, model: ModelInfo):
        self.routers = find_routers(hf, model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.replay_ids: torch.Tensor | None = None  # [tokens, layers, k]
        self.replay_mask: torch.Tensor | None = None  # [tokens]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def reset(self) -> None:
        self.calls = [[] for _ in self.routers]
        self.replay_ids = self.replay_mask = None

    def set_replay(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.replay_ids, self.replay_mask = ids.long(), mask.bool()

    def layer_calls(self) -> list[list[torch.Tensor]]:
        return self.calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, scores, indices = output
            if self.replay_ids is not None:
                chosen = torch.where(self.replay_mask[:, None], self.replay_ids[:, layer], indices)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
                if getattr(module, "norm_topk_prob", True):
                    weights /= weights.sum(dim=-1, keepdim=True)
                output = (logits, weights.to(scores.dtype), chosen)
                indices = chosen
            self.calls[layer].append(indices.detach())
            return output

        return hook
