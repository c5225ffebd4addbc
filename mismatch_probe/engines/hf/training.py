"""`hf` training: one full-sequence transformers forward, as FSDP trainers run it, on the device of
`--engine-arg device` (or spread by `device_map`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from mismatch_probe.engines.base import ScoreOptions, TrainingEngine
from mismatch_probe.engines.forward.fingerprint import hf_fingerprint
from mismatch_probe.engines.forward.host_copy import to_host
from mismatch_probe.engines.forward.logprobs import LogprobOptions, gather_logprobs
from mismatch_probe.engines.forward.scoring import BatchGrid, assemble_records
from mismatch_probe.engines.hf.device import DeviceOptions, input_device, placement_facts
from mismatch_probe.engines.hf.knobs import KNOB_KEYS, KnobOptions, Knobs, apply_knobs
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.engines.hf.quant_options import QuantOptions
from mismatch_probe.engines.hf.routing import attach_router_tap
from mismatch_probe.engines.options import build_options
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord
from mismatch_probe.vocab import FINGERPRINT_KEY

# What `reconfigure` switches on the loaded model; any other option needs a fresh load.
SWITCHABLE = (*KNOB_KEYS, "logprob_chunk")


@dataclass(frozen=True)
class HFTrainingOptions(KnobOptions, QuantOptions, DeviceOptions, LogprobOptions):
    """Where the model runs, how many positions share one LM-head chunk, how the model is quantized (a training
    pass with the rollout's own quantization, as QAT sees the weights) and its knobs (engines/hf/knobs.py)."""

    def __post_init__(self) -> None:
        DeviceOptions.__post_init__(self)
        self.check_quant()
        self.check_knobs()


@dataclass
class TrainingModel:
    hf: torch.nn.Module
    fingerprint: dict | None  # the checkpoint's, before any quantization
    quantized: dict | None  # the manifest's `quantization` entry; None when not quantized
    knobs: Knobs


def load_training_model(model, dtype: str, options: HFTrainingOptions) -> TrainingModel:
    """The model as this engine computes with it: loaded and placed, fingerprinted, quantized (weights, and the
    activation hooks), then its knobs switched (the fp32 LM head and routers copy the quantized weights). `probe
    locate` builds its hf configurations with this function, so every option that changes what the model
    computes belongs here, not in the engine's constructor."""
    hf = load_hf_model(model, dtype, options)
    fingerprint = hf_fingerprint(hf, model.vocab_size)
    quantized = options.quantize(hf, model.path)
    return TrainingModel(hf=hf, fingerprint=fingerprint, quantized=quantized, knobs=apply_knobs(hf, model, options))


class HFTrainingEngine(TrainingEngine):
    name = "hf"
    Options = HFTrainingOptions

    def __init__(self, model, config):
        super().__init__(model, config)
        loaded = load_training_model(model, config.dtype, self.options)
        self.hf, self.fingerprint, self.quantized = loaded.hf, loaded.fingerprint, loaded.quantized
        self.knobs = loaded.knobs  # switched again by reconfigure
        self.device = input_device(self.hf)
        self.tap = attach_router_tap(self.hf, model)
        self.writes_router_margin = self.tap is not None
        pad = self.hf.generation_config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def describe(self) -> dict:
        weights = {FINGERPRINT_KEY: self.fingerprint}
        return super().describe() | placement_facts(self.hf, self.options) | self.knobs.describe() | weights

    def reconfigure(self, engine_args: dict) -> bool:
        """The knobs and logprob_chunk switch in place (switching back restores the original computation
        exactly); a different device or quantization needs a fresh load: False, nothing changed."""
        options = build_options(self.Options, self.name, engine_args)
        fixed = [f.name for f in fields(options) if f.name not in SWITCHABLE]
        if any(getattr(options, key) != getattr(self.options, key) for key in fixed):
            return False
        self.knobs.apply(options)
        self.options = options
        return True

    def quantization(self) -> dict | None:
        return self.quantized

    @torch.no_grad()
    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        if not batch:
            return []
        grid = BatchGrid.left_padded(batch, options.extra_padding)  # left padding, matching generate
        replay = grid.replay(batch, self.model)
        attention = torch.from_numpy(grid.real()).long().to(self.device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        if self.tap:
            self.tap.reset()
            if replay is not None:
                ids, force = replay
                shape = self.model.routing
                self.tap.set_replay(
                    torch.from_numpy(ids).view(-1, shape.num_layers, shape.top_k).to(self.device),
                    torch.from_numpy(force).view(-1).to(self.device),
                )
            if options.router_logprobs:
                old = grid.old_experts(batch, self.model)
                shape = self.model.routing
                old = None if old is None else torch.from_numpy(old).view(-1, shape.num_layers, shape.top_k)
                self.tap.set_router_logprobs(None if old is None else old.to(self.device))
        hidden = self.hf.model(
            input_ids=grid.tokens(batch, self.pad_id).to(self.device),
            attention_mask=attention,
            position_ids=position_ids,
        ).last_hidden_state
        targets = grid.targets(batch)
        rows, columns, token_ids = (
            torch.from_numpy(a).to(hidden.device) for a in (targets.rows, targets.columns, targets.token_ids)
        )
        scored = gather_logprobs(
            hidden[rows, columns],
            token_ids,
            self.hf.lm_head,
            options.temperature,
            self.options.logprob_chunk,
            options.truncation,
        )
        routing, margins = self._routing(len(batch), grid.width)
        router_logprobs = self._router_logprobs(len(batch), grid.width) if options.router_logprobs else None
        return assemble_records(batch, grid, scored, routing, self.model, margins, router_logprobs)

    def _router_logprobs(self, rows: int, width: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """`[rows, width, L, k]` router log-probs at the chosen experts and at the --old set's (or None)."""
        if not self.tap:
            return None
        chosen, at_old = self.tap.newest_logprobs()

        def stacked(layers: list[torch.Tensor]) -> np.ndarray:
            return torch.stack([t.view(rows, width, -1) for t in to_host(layers)], dim=2).numpy()

        return stacked(chosen), None if at_old is None else stacked(at_old)

    def _routing(self, rows: int, width: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`[rows, width, L, k]` expert ids and `[rows, width, L]` router margins of the one forward,
        copied to the host at once."""
        if not self.tap:
            return None, None
        calls = to_host(self.tap.newest_call())
        layers = len(calls) // 2
        ids = [c.view(rows, width, -1) for c in calls[:layers]]
        margins = [m.view(rows, width) for m in calls[layers:]]
        return torch.stack(ids, dim=2).numpy(), torch.stack(margins, dim=2).numpy()
