"""Training engine `megatron`: megatron-core GPTModel built from the HF config, HF weights mapped in.

Routing is captured and replayed with megatron-core's own RouterReplay (RECORD / REPLAY_FORWARD).
One process on CPU (gloo); under torchrun, TP/EP over all ranks (NCCL on GPU), every rank
computing the same records and rank 0 (`is_writer`) writing them.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from ..errors import ProbeError
from ..logprobs import gather_logprobs
from ..modelinfo import ModelInfo
from ..records import ScoreRequest, SequenceRecord
from .base import EngineConfig, ScoreOptions, TrainingEngine
from .megatron_adapters import adapter_for
from .megatron_adapters.config import TORCH_DTYPES
from .megatron_adapters.model import build_gpt_model
from .megatron_logprobs import vocab_parallel_logprobs
from .megatron_shims import apply_cpu_shims, cpu_device_scope, init_model_parallel

PAD_TOKEN = 0  # right padding: causal attention keeps it out of every real position


def _use_transformer_engine() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class MegatronTrainingEngine(TrainingEngine):
    name = "megatron"

    def __init__(self, model: ModelInfo, config: EngineConfig):
        super().__init__(model, config)
        if config.dtype not in TORCH_DTYPES:
            raise ProbeError(f"--dtype: expected one of {', '.join(TORCH_DTYPES)}, got '{config.dtype}'")
        adapter_for(model)
        init_model_parallel(config.tensor_parallel, config.expert_parallel)
        apply_cpu_shims()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.module = self._build()
        self.is_moe = bool(model.moe_layer_indices)

    def _build(self):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self.model.vocab_size % ps.get_tensor_model_parallel_world_size():
            raise ProbeError(f"--tensor-parallel: must divide the vocabulary size ({self.model.vocab_size})")
        self.use_te = _use_transformer_engine()
        # The replay instance list is global to the process: start it empty so that it holds
        # exactly this model's routers, in layer order.
        RouterReplay.clear_global_router_replay_instances()
        module = build_gpt_model(
            self.model, self.config.dtype, self.config.tensor_parallel, self.config.expert_parallel,
            self.device, self.use_te,
        )
        self.replay_instances = list(RouterReplay.global_router_replay_instances)
        if len(self.replay_instances) != len(self.model.moe_layer_indices):
            raise ProbeError(
                f"{self.model.path}: megatron built {len(self.replay_instances)} MoE layers, "
                f"config.json implies {len(self.model.moe_layer_indices)}"
            )
        return module

    @property
    def is_writer(self) -> bool:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0

    def describe(self) -> dict:
        from megatron.core.package_info import __version__

        return {
            "engine": self.name, "dtype": self.config.dtype, "megatron_core": __version__,
            "tensor_parallel": self.config.tensor_parallel, "expert_parallel": self.config.expert_parallel,
            "layer_spec": "transformer_engine" if self.use_te else "local",
        }

    # ---- scoring -------------------------------------------------------------------------

    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        if not batch:
            return []
        lengths = np.array([len(r) for r in batch])
        seq, width = int(lengths.max()) + options.extra_padding, len(batch)
        tokens = torch.full((width, seq), PAD_TOKEN, dtype=torch.int64)
        for i, request in enumerate(batch):
            tokens[i, : len(request)] = torch.as_tensor(request.token_ids, dtype=torch.int64)
        tokens = tokens.to(self.device)

        replay = self._replay_rows(batch, seq, tokens) if options.replay == "r3" and self.is_moe else None
        hidden, routing = self._forward(tokens, replay)
        logprob, top_id, top_lp = self._logprobs(hidden, tokens, lengths, batch, options.temperature)
        return self._records(batch, lengths, logprob, top_id, top_lp, routing)

    def _forward(self, tokens: torch.Tensor, replay: list[torch.Tensor] | None):
        """One forward; returns decoder hidden states `[s, b, h]` and routing `[b, s, L, k]` (or None)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        width, seq = tokens.shape
        positions = torch.arange(seq, device=self.device).expand(width, seq)
        # megatron convention: True = masked out.
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=self.device), diagonal=1)[None, None]
        self._select_replay_instances()
        if self.is_moe:
            RouterReplay.clear_global_indices()
            if replay is None:
                RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            else:
                RouterReplay.set_replay_data(replay)
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            with torch.no_grad(), cpu_device_scope(), _decoder_output_only(self.module):
                hidden = self.module(tokens, positions, causal)
            routing = None
            if self.is_moe:
                used = replay if replay is not None else RouterReplay.get_recorded_data()
                # Router rows are sequence-major: row r is token (r // b, r % b).
                routing = torch.stack([u.to("cpu") for u in used]).view(len(used), seq, width, -1).permute(2, 1, 0, 3)
        finally:
            if self.is_moe:
                RouterReplay.clear_global_router_replay_action()
                RouterReplay.clear_global_indices()
        return hidden, routing

    def _select_replay_instances(self) -> None:
        """Another model built in this process may have replaced the global instance list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances
        if instances != self.replay_instances:
            instances[:] = self.replay_instances

    def _replay_rows(self, batch: list[ScoreRequest], seq: int, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per MoE layer, the `[s*b, k]` expert ids to force.

        Padding gets ids 0..k-1 (it cannot reach a real position). A real position without replay
        ids takes the engine's own choice from a recording forward of the same batch, except when
        it is its sequence's last token, whose routing reaches no scored log-prob (then 0..k-1).
        """
        layers, k = len(self.model.moe_layer_indices), self.model.top_k
        rows = np.broadcast_to(np.arange(k, dtype=np.int64), (len(batch), seq, layers, k)).copy()
        missing = np.zeros((len(batch), seq), dtype=bool)
        for i, request in enumerate(batch):
            n = len(request)
            experts, valid = request.replay_experts, request.replay_valid
            if experts is None or valid is None:
                raise ProbeError(f"sample {request.sample_id}: replay 'r3' needs the rollout's routed experts")
            if experts.shape != (n, layers, k):
                raise ProbeError(
                    f"sample {request.sample_id}: replay experts have shape {experts.shape}, expected {(n, layers, k)}"
                )
            valid = np.asarray(valid, dtype=bool)
            if valid.any() and int(experts[valid].max()) >= self.model.num_experts:
                raise ProbeError(
                    f"sample {request.sample_id}: replay expert id {int(experts[valid].max())} "
                    f">= num_experts {self.model.num_experts}"
                )
            rows[i, :n][valid] = experts[valid]
            missing[i, : n - 1] = ~valid[: n - 1]
        if missing.any():
            _, own = self._forward(tokens, None)
            rows[missing] = own.numpy()[missing]
        # [b, s, L, k] -> per layer [s*b, k], sequence-major.
        per_layer = torch.from_numpy(rows).permute(2, 1, 0, 3).reshape(layers, seq * len(batch), k)
        return [layer.contiguous().to(self.device) for layer in per_layer]

    def _logprobs(self, hidden, tokens, lengths, batch, temperature):
        """Log-probs of each response token (hidden state of the position before it)."""
        from megatron.core import parallel_state as ps

        width = tokens.shape[0]
        src, dst = [], []
        for i, request in enumerate(batch):
            first = max(request.prompt_len, 1)
            positions = np.arange(first, lengths[i])
            dst.append(positions + i * tokens.shape[1])
            src.append((positions - 1) * width + i)  # hidden is [s, b, h] flattened sequence-major
        dst, src = np.concatenate(dst), np.concatenate(src)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])[torch.from_numpy(src).to(self.device)]
        targets = tokens.reshape(-1)[torch.from_numpy(dst).to(self.device)]

        output_layer = self.module.output_layer
        weight = self.module.shared_embedding_or_output_weight() if self.module.share_embeddings_and_output_weights else None

        def project(h: torch.Tensor) -> torch.Tensor:
            with cpu_device_scope():
                return output_layer(h, weight=weight)[0]

        chunk = self.config.logprob_chunk
        tp = ps.get_tensor_model_parallel_world_size()
        if tp == 1:
            values = gather_logprobs(flat_hidden, targets, project, temperature, chunk)
        else:
            start = ps.get_tensor_model_parallel_rank() * (self.model.vocab_size // tp)
            values = vocab_parallel_logprobs(
                flat_hidden, targets, project, temperature, chunk, start, ps.get_tensor_model_parallel_group()
            )
        full = tokens.numel()
        out = []
        for value, dtype in zip(values, (np.float32, np.int64, np.float32)):
            array = np.zeros(full, dtype=dtype)
            array[dst] = value.numpy()
            out.append(array.reshape(tokens.shape))
        return out

    def _records(self, batch, lengths, logprob, top_id, top_lp, routing) -> list[SequenceRecord]:
        records = []
        for i, request in enumerate(batch):
            n = int(lengths[i])
            valid = np.arange(n) >= max(request.prompt_len, 1)
            experts = routing[i, :n].numpy().astype(np.int64) if routing is not None else None
            records.append(
                SequenceRecord(
                    sample_id=request.sample_id,
                    prompt_id=request.prompt_id,
                    token_ids=np.asarray(request.token_ids),
                    prompt_len=request.prompt_len,
                    logprob=logprob[i, :n].copy(),
                    logprob_valid=valid,
                    top_token_id=top_id[i, :n].copy(),
                    top_logprob=top_lp[i, :n].copy(),
                    experts=experts,
                    experts_valid=np.ones(n, dtype=bool) if experts is not None else None,
                )
            )
        return records


@contextmanager
def _decoder_output_only(module):
    """GPTModel returns the final-norm hidden states `[s, b, h]` instead of logits: the LM head
    is applied later in chunks, so full-vocabulary logits for the batch never exist."""
    module.post_process = False
    try:
        yield
    finally:
        module.post_process = True
