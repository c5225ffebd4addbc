"""The megatron configuration of `probe locate`: the megatron training engine's GPTModel (megatron-core, built
from the HF config with the HF weights mapped in, engines/megatron/) with forward hooks on its modules.

Matched to the hf side by layer index and operation (the adapters' name map: input_layernorm and
pre_mlp_layernorm are hf's input_layernorm and post_attention_layernorm, final_layernorm is hf's norm):

| op | megatron modules |
|---|---|
| attention | `decoder.layers[i].input_layernorm` then `.self_attention` (its output before the residual add; with
  TransformerEngine's spec the norm is fused into `linear_qkv` and `input_layernorm` is an identity) |
| router | `.mlp.router` (TopKRouter): the experts of its routing map |
| mlp | `.pre_mlp_layernorm` then `.mlp` (MoELayer or MLP) |
| block | `decoder.layers[i]` |
| final_norm, logits | `decoder.final_layernorm`, `output_layer` |

The engine scores right-padded `[s, b, h]` batches with a causal mask only (engines/megatron/training.py); locate
keeps that. Every captured tensor is turned into the hf side's layout (`[b, s, h]`, left-padded; routers
`[b·s, ...]` b-major) before it is recorded, and an input from the other side is turned back before it is fed to
a megatron module, so both sides' records are compared position by position and `own` feeds a's input to b's
module. An MoE mlp's own pass replays the other side's chosen experts through megatron-core's RouterReplay
(REPLAY_FORWARD: the gate weights are this router's scores at those experts)."""

from __future__ import annotations

import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.locate.ops import ATTENTION, BLOCK, FINAL_NORM, LOGITS, MLP, ROUTER, LayerOps, ModelOps, _reduction
from mismatch_probe.locate.side import Key, Record, Select, _call, _first, _hidden_arg
from mismatch_probe.locate.spec import EngineSpec
from mismatch_probe.model.routing_shape import ModelInfo


class BatchLayout:
    """Left-padded `[b, s, ...]` (hf's, the records') <-> right-padded `[s, b, ...]` (megatron's) for one batch."""

    def __init__(self, attention: torch.Tensor):
        self.rows, self.width = attention.shape
        self.pads = (self.width - attention.sum(-1)).long()  # left pads per row
        columns = torch.arange(self.width)[None, :]
        self.to_right = (columns + self.pads[:, None]) % self.width  # right[r, j] = left[r, (j + pad) % w]
        self.to_left = (columns - self.pads[:, None]) % self.width

    @staticmethod
    def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        index = index.to(tensor.device).view(*index.shape, *([1] * (tensor.dim() - 2))).expand_as(tensor)
        return tensor.gather(1, index)

    def tokens(self, left: torch.Tensor) -> torch.Tensor:
        """`[b, s]` left-padded -> right-padded, still `[b, s]` (GPTModel's input_ids)."""
        return self._gather(left, self.to_right)

    def ours(self, megatron: torch.Tensor) -> torch.Tensor:
        """megatron `[s, b, ...]` right-padded -> `[b, s, ...]` left-padded."""
        return self._gather(megatron.transpose(0, 1), self.to_left)

    def theirs(self, left: torch.Tensor) -> torch.Tensor:
        """`[b, s, ...]` left-padded -> megatron `[s, b, ...]` right-padded."""
        return self._gather(left, self.to_right).transpose(0, 1).contiguous()

    def flat_ours(self, megatron: torch.Tensor) -> torch.Tensor:
        """a router's `[s·b, ...]` rows -> `[b·s, ...]` b-major, left-padded (hf's flattening)."""
        shaped = megatron.reshape(self.width, self.rows, *megatron.shape[1:])
        return self.ours(shaped).reshape(self.rows * self.width, *megatron.shape[1:])

    def flat_theirs(self, flat: torch.Tensor) -> torch.Tensor:
        shaped = flat.reshape(self.rows, self.width, *flat.shape[1:])
        return self.theirs(shaped).reshape(self.rows * self.width, *flat.shape[1:])


def _norm_or_none(module):
    from megatron.core.transformer.identity_op import IdentityOp

    return None if module is None or isinstance(module, IdentityOp) else module


def _chosen(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """The expert ids of a `[tokens, experts]` boolean routing map, `[tokens, k]`."""
    return routing_map.to(torch.int8).topk(k, dim=-1).indices


class MegatronSide:
    """Same interface as side.Side: forward (this side's record) and own (our operations on another record)."""

    def __init__(self, spec: EngineSpec, info: ModelInfo):
        from transformers import AutoConfig

        from mismatch_probe.engines.base import EngineConfig
        from mismatch_probe.engines.megatron.training import MegatronTrainingEngine

        self.spec, self.info = spec, info
        self.engine = MegatronTrainingEngine(info, EngineConfig(dtype=spec.dtype, engine_args=dict(spec.engine_args)))
        module = self.engine.module
        self.module, self.device = module, self.engine.device
        self.k = info.top_k
        decoder = module.decoder

        class _Config:  # what ops._reduction reads
            config = AutoConfig.from_pretrained(info.path)

        layers = []
        for i, layer in enumerate(decoder.layers):
            mlp = layer.mlp
            layers.append(
                LayerOps(
                    index=i,
                    layer=layer,
                    attention_norm=_norm_or_none(layer.input_layernorm),
                    attention=layer.self_attention,
                    mlp_norm=_norm_or_none(layer.pre_mlp_layernorm),
                    mlp=mlp,
                    router=getattr(mlp, "router", None),
                )
            )
        if [i for i, ops in enumerate(layers) if ops.router is not None] != list(info.moe_layer_indices):
            raise ProbeError(f"{info.path}: megatron's MoE layers do not match config.json's")
        self.ops = ModelOps(
            decoder=decoder,
            layers=layers,
            final_norm=decoder.final_layernorm,
            lm_head=module.output_layer,
            reduction=_reduction(_Config),
        )
        self.dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        self.record: Record | None = None
        self.select: Select | None = None
        self.layout: BatchLayout | None = None
        for ops in layers:
            self._hook_layer(ops)
        self.ops.final_norm.register_forward_pre_hook(self._input((None, FINAL_NORM)))
        self.ops.final_norm.register_forward_hook(self._output((None, FINAL_NORM)))

    # ---- hooks --------------------------------------------------------------------------------
    def _hook_layer(self, ops: LayerOps) -> None:
        i = ops.index
        ops.layer.register_forward_pre_hook(self._input((i, BLOCK), call=True), with_kwargs=True)
        ops.layer.register_forward_hook(self._output((i, BLOCK)))
        for key, norm, module in ((i, ATTENTION), ops.attention_norm, ops.attention), ((i, MLP), ops.mlp_norm, ops.mlp):
            if norm is not None:
                norm.register_forward_pre_hook(self._input(key))
            module.register_forward_pre_hook(self._input(key, call=True, hidden=norm is None), with_kwargs=True)
            module.register_forward_hook(self._output(key))
        if ops.router is not None:
            ops.router.register_forward_pre_hook(self._input((i, ROUTER), flat=True), with_kwargs=True)
            ops.router.register_forward_hook(self._router(i))

    def _input(self, key: Key, call: bool = False, hidden: bool = True, flat: bool = False):
        def hook(module, args, kwargs=None):
            if self.record is None:
                return None
            if hidden:
                tensor = self.layout.ours(_hidden_arg(args, kwargs or {}).detach())
                self.record.inputs[key] = tensor.reshape(-1, tensor.shape[-1]) if flat else tensor
            if call:
                self.record.calls[key] = (args, kwargs or {})
            return None

        return hook

    def _output(self, key: Key):
        def hook(module, args, output):
            if self.record is not None:
                self.record.outputs[key] = self.select.hidden(self.layout.ours(_first(output).detach()))

        return hook

    def _router(self, layer: int):
        def hook(module, args, output):
            if self.record is not None:
                chosen = self.layout.flat_ours(_chosen(output[1].detach(), self.k))
                self.record.routes[layer] = chosen
                self.record.chosen[layer] = self.select.flat(chosen)

        return hook

    # ---- passes -------------------------------------------------------------------------------
    def _scope(self):
        from mismatch_probe.engines.megatron.shims import cpu_device_scope

        return cpu_device_scope()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, attention: torch.Tensor, select: Select) -> Record:
        """The engine's own forward: right-padded, positions from 0, causal mask only."""
        from mismatch_probe.engines.megatron.training import _decoder_output_only

        self.layout = BatchLayout(attention=attention)
        width, seq = tokens.shape
        right = self.layout.tokens(tokens).to(self.device)
        positions = torch.arange(seq, device=self.device).expand(width, seq)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=self.device), diagonal=1)[None, None]
        self.engine._select_replay_instances()
        self.record, self.select = Record(), select
        try:
            with self._scope(), _decoder_output_only(self.module):
                self.module(right, positions, causal)
            record = self.record
        finally:
            self.record = None
        record.outputs[(None, LOGITS)] = self._logits(record.outputs[(None, FINAL_NORM)])
        return record

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight = module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights else None
        with self._scope():
            return module.output_layer(hidden.to(device=self.device, dtype=self.dtype), weight=weight)[0]

    def _theirs(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.layout.theirs(tensor.to(device=self.device, dtype=self.dtype))

    @torch.no_grad()
    def own(self, other: Record, mine: Record, select: Select) -> Record:
        """Each of our operations on `other`'s input (turned into our layout), with our own rotary embeddings and
        mask (`mine`'s calls); an MoE mlp with `other`'s chosen experts replayed."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        out = Record()
        layout = self.layout
        with self._scope():
            for ops in self.ops.layers:
                i = ops.index
                for key, norm, module in (
                    ((i, ATTENTION), ops.attention_norm, ops.attention),
                    ((i, MLP), ops.mlp_norm, ops.mlp),
                ):
                    hidden = self._theirs(other.inputs[key])
                    hidden = norm(hidden) if norm is not None else hidden
                    replay = ops.router.router_replay if key[1] == MLP and ops.router is not None else None
                    if replay is not None:
                        ids = layout.flat_theirs(other.routes[i].to(self.device))
                        replay.set_target_indices(ids)
                        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                    try:
                        result = _first(_call(module, mine.calls[key], hidden))
                    finally:
                        if replay is not None:
                            replay.clear_indices()
                            replay.clear_router_replay_action()
                    out.outputs[key] = select.hidden(layout.ours(result))
                if ops.router is not None:
                    routed = ops.router(self.layout.flat_theirs(other.inputs[(i, ROUTER)].to(self.device, self.dtype)))
                    out.chosen[i] = select.flat(layout.flat_ours(_chosen(routed[1], self.k)))
                hidden = self._theirs(other.inputs[(i, BLOCK)])
                out.outputs[(i, BLOCK)] = select.hidden(
                    layout.ours(_first(_call(ops.layer, mine.calls[(i, BLOCK)], hidden)))
                )
            norm = self.ops.final_norm
            out.outputs[(None, FINAL_NORM)] = select.hidden(
                layout.ours(norm(self._theirs(other.inputs[(None, FINAL_NORM)])))
            )
        out.outputs[(None, LOGITS)] = self._logits(other.outputs[(None, FINAL_NORM)])
        return out
