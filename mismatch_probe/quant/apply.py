"""Fake quantization applied to a loaded model in place: each target's weight quantized as stored (a fused
expert parameter one expert and, for gate_up, one half at a time), and the activation quant as a forward
pre-hook on each quantized linear (a fused expert module: on the input of each expert product it runs)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from mismatch_probe.quant.kv import apply_kv_quant
from mismatch_probe.quant.schemes import ACT_SCHEMES, WEIGHT_SCHEMES
from mismatch_probe.quant.targets import Target, find_targets, split_targets

Fn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def quantize_model(
    model: torch.nn.Module, weight: str | None, act: str | None, skip: tuple[str, ...], kv: str | None = None
) -> dict | None:
    """Quantize `model` in place; the manifest's `quantization` entry, or None when nothing is asked for. With
    only `kv`, no linear is quantized: both module lists are empty."""
    if weight is None and act is None and kv is None:
        return None
    if kv is not None:
        apply_kv_quant(model, kv)
    quantized, skipped = split_targets(find_targets(model), skip) if weight or act else ([], [])
    if weight is not None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        for target in quantized:
            _quantize_weight(target, WEIGHT_SCHEMES[weight], tied=id(target.parameter) in embeddings)
    if act is not None:
        _hook_activations(quantized, ACT_SCHEMES[act])
    return {
        "weight": weight,
        "act": act,
        "kv": kv,
        "quantized_modules": sorted(t.name for t in quantized),
        "skipped_modules": sorted(t.name for t in skipped),
    }


def quantized_weight(target: Target, scheme: Fn) -> torch.Tensor:
    """The target's weight after `scheme`, in its stored layout and dtype."""
    w = target.parameter.detach()
    if not target.experts:
        return scheme(w)
    matrices = w.transpose(-1, -2) if target.transposed else w  # [E, out, in]
    out = torch.empty_like(matrices)
    if target.gate_up is None:
        out.copy_(scheme(matrices))
    else:
        rows = matrices.shape[-2]
        halves = (slice(0, rows // 2), slice(rows // 2, rows))
        if target.gate_up == "interleaved":
            halves = (slice(0, rows, 2), slice(1, rows, 2))
        for half in halves:  # gate, then up: two matrices per expert
            out[:, half] = scheme(matrices[:, half])
    return out.transpose(-1, -2) if target.transposed else out


def _quantize_weight(target: Target, scheme: Fn, tied: bool) -> None:
    q = quantized_weight(target, scheme)
    if tied:  # an LM head tied to the embeddings: the embeddings keep their weights
        setattr(target.module, target.attr, torch.nn.Parameter(q, requires_grad=False))
    else:
        target.parameter.data.copy_(q)


def _hook_activations(targets: list[Target], act: Fn) -> None:
    expert_modules: dict[int, tuple[torch.nn.Module, list[torch.Tensor]]] = {}
    for target in targets:
        if not target.experts:
            target.module.register_forward_pre_hook(lambda _m, args: (act(args[0]), *args[1:]))
        else:
            expert_modules.setdefault(id(target.module), (target.module, []))[1].append(target.parameter)
    for module, params in expert_modules.values():
        mode = _ExpertInputs(act, params)
        module.register_forward_pre_hook(mode.enter)
        module.register_forward_hook(mode.exit, always_call=True)


# The products an expert forward runs: eager linear / matmul / bmm, and transformers' grouped_mm paths.
_PRODUCT = re.compile(r"linear|matmul|mm")


class _ExpertInputs(TorchFunctionMode):
    """Inside a fused expert module's forward: the input of each product with one of its expert weights
    (`x @ W[e]`, `linear(x, W[e])`, a batched or grouped product) is fake-quantized first."""

    def __init__(self, act: Fn, params: list[torch.Tensor]):
        super().__init__()
        self.act = act
        self.shapes = {tuple(p.shape[-2:]) for p in params} | {tuple(p.shape[-2:])[::-1] for p in params}
        self.ids = {id(p) for p in params}

    def _expert_weight(self, w) -> bool:
        if not isinstance(w, torch.Tensor) or w.dim() < 2:
            return False
        return id(w) in self.ids or id(w._base) in self.ids or tuple(w.shape[-2:]) in self.shapes

    def enter(self, _module, _args) -> None:
        self.__enter__()

    def exit(self, _module, _args, _out) -> None:
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or str(func)
        if _PRODUCT.search(name) and len(args) >= 2 and self._expert_weight(args[1]):
            args = (self.act(args[0]), *args[1:])
        return func(*args, **kwargs)
