"""Training engine `megatron`: megatron-core GPTModel built from the HF config, HF weights mapped in.

Routing is captured and replayed with megatron-core's own RouterReplay (RECORD / REPLAY_FORWARD),
forced only where the request carries replay experts (replay.py, engines/forward/scoring.py).
One process on CPU (gloo); under torchrun, TP/EP over all ranks (NCCL on GPU), every rank
computing the same records and rank 0 (`scoring.is_writer_rank`) writing them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mismatch_probe.engines.base import EngineConfig, ScoreOptions, TrainingEngine
from mismatch_probe.engines.forward.fingerprint import megatron_fingerprint
from mismatch_probe.engines.forward.logprobs import LogprobOptions, gather_logprobs
from mismatch_probe.engines.forward.scoring import BatchGrid, assemble_records
from mismatch_probe.engines.megatron.adapters import adapter_for
from mismatch_probe.engines.megatron.adapters.model import build_gpt_model
from mismatch_probe.engines.megatron.config_file import resolve_overrides
from mismatch_probe.engines.megatron.config_record import config_record, overrides_record
from mismatch_probe.engines.megatron.logprobs import vocab_parallel_logprobs
from mismatch_probe.engines.megatron.needs import TE, choose_layer_spec
from mismatch_probe.engines.megatron.replay import MarginRule, capture_margins, replay_where_forced
from mismatch_probe.engines.megatron.shims import apply_shims, cpu_device_scope, init_model_parallel
from mismatch_probe.engines.options import option, prefix_option
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.moe import adapter_named
from mismatch_probe.model.moe.softmax_topk import SoftmaxTopK
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord
from mismatch_probe.vocab import DTYPES, FINGERPRINT_KEY

PAD_TOKEN = 0  # right padding: causal attention keeps it out of every real position


@dataclass(frozen=True)
class MegatronOptions(LogprobOptions):
    tensor_parallel: int = option(1, "tensor-parallel size (divides the torchrun world size and the vocabulary)", min=1)
    expert_parallel: int = option(
        1, "expert-parallel size (divides the torchrun world size and the expert count)", min=1
    )
    config_file: str | None = option(
        None, "verl's override_transformer_config YAML, or a file of Megatron-LM flags (slime's)"
    )
    override_transformer_config: dict = prefix_option(
        "any megatron-core TransformerConfig field, converted by its declared type (verl's name); wins over config_file"
    )

    def __post_init__(self) -> None:
        # Checked here, when the options are parsed: a bad field exits 2 before any folder is made.
        overrides = resolve_overrides(self.override_transformer_config, self.config_file)
        object.__setattr__(self, "transformer_overrides", overrides)


class MegatronTrainingEngine(TrainingEngine):
    name = "megatron"
    Options = MegatronOptions
    help_note = (
        "override_transformer_config.FIELD takes any TransformerConfig field of megatron-core 0.16.1, e.g. "
        "moe_router_dtype=fp32, moe_token_dispatcher_type=alltoall, attention_backend=local; config_file reads "
        "verl's YAML block or Megatron-LM flags. A value that needs a package not installed here "
        "(transformer_engine, grouped_gemm, apex, deep_ep) exits 2 naming it. See docs/remedies.md, megatron knobs."
    )

    def __init__(self, model: ModelInfo, config: EngineConfig):
        super().__init__(model, config)
        if config.dtype not in DTYPES:
            raise ProbeError(f"--dtype: expected one of {', '.join(DTYPES)}, got '{config.dtype}'")
        adapter_for(model)
        init_model_parallel(self.options.tensor_parallel, self.options.expert_parallel)
        apply_shims()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.module = self._build()
        self.is_moe = self.writes_router_margin = bool(model.moe_layer_indices)
        self.margin_rule = self._margin_rule() if self.is_moe else None

    def _build(self):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if self.model.vocab_size % ps.get_tensor_model_parallel_world_size():
            raise ProbeError(
                f"--engine-arg tensor_parallel={self.options.tensor_parallel}: must divide the vocabulary size "
                f"({self.model.vocab_size})"
            )
        self.layer_spec = choose_layer_spec(self.options.transformer_overrides)
        # The replay instance list is global to the process: start it empty so that it holds
        # exactly this model's routers, in layer order.
        RouterReplay.clear_global_router_replay_instances()
        module = build_gpt_model(
            self.model,
            self.config.dtype,
            self.options.tensor_parallel,
            self.options.expert_parallel,
            self.device,
            self.layer_spec == TE,
            self.options.transformer_overrides,
        )
        self.replay_instances = list(RouterReplay.global_router_replay_instances)
        if len(self.replay_instances) != len(self.model.moe_layer_indices):
            raise ProbeError(
                f"{self.model.path}: megatron built {len(self.replay_instances)} MoE layers, "
                f"config.json implies {len(self.model.moe_layer_indices)}"
            )
        return module

    def _margin_rule(self) -> MarginRule:
        config = self.module.config
        softmax_first = isinstance(adapter_named(self.model.moe_family).style, SoftmaxTopK) and not (
            config.moe_router_pre_softmax
        )
        return MarginRule(
            top_k=self.model.top_k,
            softmax_first=softmax_first,
            groups=config.moe_router_num_groups,
            groups_kept=config.moe_router_group_topk,
        )

    def describe(self) -> dict:
        from megatron.core.package_info import __version__

        return {
            "engine": self.name,
            "dtype": self.config.dtype,
            "megatron_core": __version__,
            "tensor_parallel": self.options.tensor_parallel,
            "expert_parallel": self.options.expert_parallel,
            "layer_spec": self.layer_spec,
            "transformer_config": config_record(self.module.config),
            "override_transformer_config": overrides_record(self.options.transformer_overrides),
            "config_file": None
            if self.options.config_file is None
            else str(Path(self.options.config_file).expanduser().resolve()),
            FINGERPRINT_KEY: megatron_fingerprint(self.module, self.model.vocab_size, self.options.tensor_parallel),
        }

    # ---- scoring -------------------------------------------------------------------------

    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        if not batch:
            return []
        grid = BatchGrid.right_padded(batch, options.extra_padding)
        replay = grid.replay(batch, self.model)
        tokens = grid.tokens(batch, PAD_TOKEN).to(self.device)
        hidden, routing, margins = self._forward(tokens, replay)
        targets = grid.targets(batch)
        # hidden is [s, b, h]: the state of (row, column) sits at flat index column * b + row.
        flat = torch.from_numpy(targets.columns * len(batch) + targets.rows).to(self.device)
        scored = self._logprobs(
            hidden.reshape(-1, hidden.shape[-1])[flat], torch.from_numpy(targets.token_ids), options
        )
        return assemble_records(batch, grid, scored, routing, self.model, margins)

    def _forward(self, tokens: torch.Tensor, replay: tuple[np.ndarray, np.ndarray] | None):
        """One forward; returns decoder hidden states `[s, b, h]`, routing `[b, s, L, k]` and router margins
        `[b, s, L]` (both None for a dense model)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        width, seq = tokens.shape
        positions = torch.arange(seq, device=self.device).expand(width, seq)
        # megatron convention: True = masked out.
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=self.device), diagonal=1)[None, None]
        self._select_replay_instances()
        with ExitStack() as stack:
            if self.is_moe:
                RouterReplay.clear_global_indices()
                stack.callback(RouterReplay.clear_global_indices)
                stack.callback(RouterReplay.clear_global_router_replay_action)
                RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
                if replay is not None:
                    stack.enter_context(replay_where_forced(self.replay_instances, *replay, self.device))
                margins = stack.enter_context(capture_margins(self.replay_instances, self.margin_rule))
            with torch.no_grad(), cpu_device_scope(), _decoder_output_only(self.module):
                hidden = self.module(tokens, positions, causal)
            if not self.is_moe:
                return hidden, None, None
            # Router rows are sequence-major: row r is token (r // b, r % b).
            used = torch.stack([u.to("cpu") for u in RouterReplay.get_recorded_data()])
            routing = used.view(len(used), seq, width, -1).permute(2, 1, 0, 3)
            margin = (
                torch.stack([calls[0].to("cpu") for calls in margins]).view(len(margins), seq, width).permute(2, 1, 0)
            )
        return hidden, routing.numpy(), margin.numpy()

    def _select_replay_instances(self) -> None:
        """Another model built in this process may have replaced the global instance list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances
        if instances != self.replay_instances:
            instances[:] = self.replay_instances

    def _logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, options: ScoreOptions):
        """Log-probs of `targets` from the hidden states that predict them, through the (TP-split) LM head."""
        from megatron.core import parallel_state as ps

        output_layer = self.module.output_layer
        weight = (
            self.module.shared_embedding_or_output_weight() if self.module.share_embeddings_and_output_weights else None
        )

        def project(h: torch.Tensor) -> torch.Tensor:
            with cpu_device_scope():
                return output_layer(h, weight=weight)[0]

        chunk, targets = self.options.logprob_chunk, targets.to(self.device)
        tp = ps.get_tensor_model_parallel_world_size()
        if tp == 1:
            return gather_logprobs(hidden, targets, project, options.temperature, chunk, options.truncation)
        if options.truncation is not None:
            raise ProbeError(
                "--sampling rollout with --tp > 1: the megatron engine's vocabulary-parallel log-probs do not "
                "compute a top-p support; score with --tp 1 or --engine hf"
            )
        start = ps.get_tensor_model_parallel_rank() * (self.model.vocab_size // tp)
        return vocab_parallel_logprobs(
            hidden, targets, project, options.temperature, chunk, start, ps.get_tensor_model_parallel_group()
        )


@contextmanager
def _decoder_output_only(module):
    """GPTModel returns the final-norm hidden states `[s, b, h]` instead of logits: the LM head
    is applied later in chunks, so full-vocabulary logits for the batch never exist."""
    module.post_process = False
    try:
        yield
    finally:
        module.post_process = True
