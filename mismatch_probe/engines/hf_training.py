"""`hf` training: one full-sequence transformers forward, as FSDP trainers run it."""

from __future__ import annotations

import numpy as np
import torch

from ..records import ScoreRequest, SequenceRecord
from .base import ScoreOptions, TrainingEngine
from .hf_model import load_hf_model
from .hf_routing import attach_router_tap
from .logprobs import LogprobOptions, gather_logprobs
from .scoring import BatchGrid, assemble_records


class HFTrainingEngine(TrainingEngine):
    name = "hf"
    Options = LogprobOptions

    def __init__(self, model, config):
        super().__init__(model, config)
        self.hf = load_hf_model(model, config.dtype)
        self.tap = attach_router_tap(self.hf, model)
        self.writes_router_margin = self.tap is not None
        pad = self.hf.generation_config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    @torch.no_grad()
    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        if not batch:
            return []
        grid = BatchGrid.left_padded(batch, options.extra_padding)  # left padding, matching generate
        replay = grid.replay(batch, self.model)
        attention = torch.from_numpy(grid.real()).long()
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        if self.tap:
            self.tap.reset()
            if replay is not None:
                ids, force = replay
                shape = self.model.routing
                self.tap.set_replay(
                    torch.from_numpy(ids).view(-1, shape.num_layers, shape.top_k), torch.from_numpy(force).view(-1)
                )
        hidden = self.hf.model(
            input_ids=grid.tokens(batch, self.pad_id), attention_mask=attention, position_ids=position_ids
        ).last_hidden_state
        targets = grid.targets(batch)
        scored = gather_logprobs(
            hidden[torch.from_numpy(targets.rows), torch.from_numpy(targets.columns)],
            torch.from_numpy(targets.token_ids),
            self.hf.lm_head,
            options.temperature,
            self.options.logprob_chunk,
        )
        routing, margins = self._routing(len(batch), grid.width)
        return assemble_records(batch, grid, scored, routing, self.model, margins)

    def _routing(self, rows: int, width: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`[rows, width, L, k]` expert ids and `[rows, width, L]` router margins of the one forward."""
        if not self.tap:
            return None, None
        layers = [calls[0].view(rows, width, -1) for calls in self.tap.layer_calls()]
        margins = [calls[0].view(rows, width) for calls in self.tap.layer_margins()]
        return torch.stack(layers, dim=2).numpy(), torch.stack(margins, dim=2).numpy()
