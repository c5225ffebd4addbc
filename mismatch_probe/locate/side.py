"""One configuration's model with forward hooks: what it computes on the chosen sequences (its record), and
its own operations applied to the other side's inputs (own).

A record keeps, per (layer, op), the op's full input (for the other side's own pass), the module call's other
arguments (rotary embeddings, mask: this side's own), and its output at the selected positions only. Router
calls are flattened to `[tokens, hidden]` (routing.py's contract); their selected rows are row * width + column."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mismatch_probe.engines.hf.device import input_device
from mismatch_probe.engines.hf.routing import find_routers
from mismatch_probe.engines.hf.training import load_training_model
from mismatch_probe.engines.hf.upcast import compute_dtype
from mismatch_probe.locate.ops import ATTENTION, BLOCK, FINAL_NORM, LOGITS, MLP, ROUTER, model_ops
from mismatch_probe.locate.spec import EngineSpec
from mismatch_probe.model.moe import adapter_named
from mismatch_probe.model.routing_shape import ModelInfo

Key = tuple[int | None, str]  # (layer, op); layer None for final_norm and logits


@dataclass
class Select:
    """The positions measured: the hidden state at p - 1 of every scored response token p (it makes p's log-prob)."""

    rows: torch.Tensor
    columns: torch.Tensor
    width: int

    def hidden(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.rows.to(tensor.device), self.columns.to(tensor.device)]

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[(self.rows * self.width + self.columns).to(tensor.device)]


@dataclass
class Record:
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    calls: dict[Key, tuple[tuple, dict]] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # at the selected positions
    router_outputs: dict[int, object] = field(default_factory=dict)  # hf: whole, for replay in another hf side's mlp
    routes: dict[int, torch.Tensor] = field(default_factory=dict)  # [b·s, k] expert ids of every position, b-major
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)  # [selected tokens, k] expert ids
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # hf: [selected tokens, experts] router scores


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def router_scores(output) -> torch.Tensor:
    """The router's continuous output, `[tokens, experts]`: its logits (its first output; Llama-4's is its
    top-k scores). It carries a weight change that moves the gate weights without changing any choice."""
    return _first(output).detach().float()


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _call(module: torch.nn.Module, call: tuple[tuple, dict], hidden: torch.Tensor):
    """`module` called as it was in the side's own forward, with `hidden` in place of its hidden states."""
    args, kwargs = call
    if args:
        return module(hidden, *args[1:], **kwargs)
    return module(**(kwargs | {"hidden_states": hidden}))


def _cast_like(value, like):
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=like.dtype) if value.is_floating_point() else value.to(like.device)
    return type(value)(_cast_like(v, w) for v, w in zip(value, like))


class Side:
    def __init__(self, spec: EngineSpec, info: ModelInfo):
        self.spec, self.info = spec, info
        # exactly as the hf training engine loads it: placed, fake-quantized and its knobs (attention, fp32 LM
        # head and routers) switched as its options say
        self.hf = load_training_model(info, spec.dtype, spec.options()).hf
        routers = find_routers(self.hf, info)
        self.style = adapter_named(info.moe_family).style if routers else None
        self.ops = model_ops(self.hf, info, routers)
        self.device = input_device(self.hf)
        self.dtype = compute_dtype(self.hf)  # fp32 over a bf16 checkpoint holds bf16 parameters, computes fp32
        self.record: Record | None = None  # recording while set
        self.select: Select | None = None
        # (layer, the other side's router output or, from another engine, its [b·s, k] expert ids) during own mlp
        self.replay: tuple[int, object] | None = None
        for ops in self.ops.layers:
            self._hook_layer(ops)
        self.ops.final_norm.register_forward_pre_hook(self._input((None, FINAL_NORM)))
        self.ops.final_norm.register_forward_hook(self._output((None, FINAL_NORM)))

    # ---- hooks --------------------------------------------------------------------------------
    def _hook_layer(self, ops) -> None:
        i = ops.index
        ops.layer.register_forward_pre_hook(self._input((i, BLOCK), call=True), with_kwargs=True)
        ops.layer.register_forward_hook(self._output((i, BLOCK)))
        for key, norm, module in ((i, ATTENTION), ops.attention_norm, ops.attention), ((i, MLP), ops.mlp_norm, ops.mlp):
            if norm is not None:
                norm.register_forward_pre_hook(self._input(key))
            module.register_forward_pre_hook(self._input(key, call=True, hidden=norm is None), with_kwargs=True)
            module.register_forward_hook(self._output(key))
        if ops.router is not None:
            # first among its pre-hooks: the router's input as given, before an act_quant hook rounds it
            ops.router.register_forward_pre_hook(self._input((i, ROUTER)), prepend=True)
            ops.router.register_forward_hook(self._router(i))

    def _input(self, key: Key, call: bool = False, hidden: bool = True):
        def hook(module, args, kwargs=None):
            if self.record is None:
                return None
            if hidden:
                self.record.inputs[key] = _hidden_arg(args, kwargs or {}).detach()
            if call:
                self.record.calls[key] = (args, kwargs or {})
            return None

        return hook

    def _output(self, key: Key):
        def hook(module, args, output):
            if self.record is not None:
                self.record.outputs[key] = self.select.hidden(_first(output).detach())

        return hook

    def _router(self, layer: int):
        def hook(module, args, output):
            if self.replay is not None and self.replay[0] == layer:
                if isinstance(self.replay[1], torch.Tensor):  # another engine's expert ids: our gates at them
                    return self.style.replay(
                        module, output, self.replay[1].to(self.style.chosen(module, output).device)
                    )
                return _cast_like(self.replay[1], output)  # the other side's routes and gate weights, in our dtype
            if self.record is not None:
                self.record.router_outputs[layer] = output
                chosen = self.style.chosen(module, output).detach()
                self.record.routes[layer] = chosen
                self.record.chosen[layer] = self.select.flat(chosen)
                self.record.scores[layer] = self.select.flat(router_scores(output))
            return None

        return hook

    # ---- passes -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, attention: torch.Tensor, select: Select) -> Record:
        """This side's forward over the batch, recorded."""
        self.record, self.select = Record(), select
        attention = attention.to(self.device)
        try:
            self.ops.decoder(
                input_ids=tokens.to(self.device),
                attention_mask=attention,
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                use_cache=False,
            )
            record = self.record
        finally:
            self.record = None
        norm = record.outputs[(None, FINAL_NORM)]
        record.outputs[(None, LOGITS)] = self.ops.lm_head(norm.to(self.ops.lm_head.weight.device))
        return record

    def _as_ours(self, tensor: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        weight = next((p for p in module.parameters() if p.is_floating_point()), None)
        return tensor.to(device=weight.device if weight is not None else self.device, dtype=self.dtype)

    @torch.no_grad()
    def own(self, other: Record, mine: Record, select: Select) -> Record:
        """Each of our operations on `other`'s input, with our own rotary embeddings and mask (`mine`'s calls);
        an MoE mlp with `other`'s routes replayed. Outputs at the selected positions; routers' chosen experts."""
        out = Record()
        for ops in self.ops.layers:
            i = ops.index
            for key, norm, module in (
                ((i, ATTENTION), ops.attention_norm, ops.attention),
                ((i, MLP), ops.mlp_norm, ops.mlp),
            ):
                hidden = self._as_ours(other.inputs[key], module if norm is None else norm)
                hidden = norm(hidden) if norm is not None else hidden
                routes = other.router_outputs.get(i, other.routes.get(i))
                self.replay = (i, routes) if key[1] == MLP and ops.router is not None else None
                try:
                    out.outputs[key] = select.hidden(_first(_call(module, mine.calls[key], hidden)))
                finally:
                    self.replay = None
            if ops.router is not None:
                routed = ops.router(self._as_ours(other.inputs[(i, ROUTER)], ops.router))
                out.chosen[i] = select.flat(self.style.chosen(ops.router, routed))
                out.scores[i] = select.flat(router_scores(routed))
            hidden = self._as_ours(other.inputs[(i, BLOCK)], ops.layer)
            out.outputs[(i, BLOCK)] = select.hidden(_first(_call(ops.layer, mine.calls[(i, BLOCK)], hidden)))
        norm = self.ops.final_norm
        out.outputs[(None, FINAL_NORM)] = select.hidden(norm(self._as_ours(other.inputs[(None, FINAL_NORM)], norm)))
        head = self.ops.lm_head
        out.outputs[(None, LOGITS)] = head(self._as_ours(other.outputs[(None, FINAL_NORM)], head))
        return out
