"""`hf` training: one full-sequence transformers forward, as FSDP trainers run it."""

from __future__ import annotations

import numpy as np
import torch

from ..logprobs import gather_logprobs
from ..records import ScoreRequest, SequenceRecord
from .base import ScoreOptions, TrainingEngine
from .hf_model import load_hf_model
from .hf_routing import attach_router_tap


class HFTrainingEngine(TrainingEngine):
    name = "hf"

    def __init__(self, model, config):
        super().__init__(model, config)
        self.hf = load_hf_model(model, config.dtype)
        self.tap = attach_router_tap(self.hf, model)
        pad = self.hf.generation_config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    @torch.no_grad()
    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        rows = len(batch)
        width = max(len(r) for r in batch) + options.extra_padding
        starts = [width - len(r) for r in batch]  # left padding, matching generate
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for row, (request, start) in enumerate(zip(batch, starts)):
            input_ids[row, start:] = torch.from_numpy(request.token_ids)
            attention[row, start:] = 1
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        if self.tap:
            self.tap.reset()
            if options.replay == "r3":
                self.tap.set_replay(*self._replay_tensors(batch, starts, width))
        hidden = self.hf.model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).last_hidden_state

        # Position p's log-prob comes from the hidden state at p - 1; only response positions are scored.
        pred_rows, pred_cols, targets = [], [], []
        for row, (request, start) in enumerate(zip(batch, starts)):
            positions = np.arange(request.prompt_len, len(request))
            pred_rows.append(np.full(len(positions), row))
            pred_cols.append(start + positions - 1)
            targets.append(request.token_ids[positions])
        pred_rows, pred_cols = np.concatenate(pred_rows), np.concatenate(pred_cols)
        logprob, top_id, top_logprob = gather_logprobs(
            hidden[torch.from_numpy(pred_rows), torch.from_numpy(pred_cols)],
            torch.from_numpy(np.concatenate(targets)),
            self.hf.lm_head,
            options.temperature,
            self.config.logprob_chunk,
        )
        routing = self._routing(rows, width)
        records, offset = [], 0
        for row, (request, start) in enumerate(zip(batch, starts)):
            n, p = len(request), request.prompt_len
            take = slice(offset, offset + n - p)
            offset += n - p
            record = SequenceRecord(
                sample_id=request.sample_id,
                prompt_id=request.prompt_id,
                token_ids=request.token_ids,
                prompt_len=p,
                logprob=np.concatenate([np.zeros(p, np.float32), logprob[take].numpy()]),
                logprob_valid=np.arange(n) >= p,
                top_token_id=np.concatenate([np.zeros(p, np.int64), top_id[take].numpy()]),
                top_logprob=np.concatenate([np.zeros(p, np.float32), top_logprob[take].numpy()]),
            )
            if routing is not None:
                record.experts = routing[row, start:]
                record.experts_valid = np.ones(n, dtype=bool)
            records.append(record)
        return records

    def _replay_tensors(self, batch: list[ScoreRequest], starts: list[int], width: int):
        shape = self.model.routing
        ids = torch.zeros((len(batch), width, shape.num_layers, shape.top_k), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.bool)
        for row, (request, start) in enumerate(zip(batch, starts)):
            if request.replay_experts is not None:
                ids[row, start:] = torch.from_numpy(request.replay_experts.astype(np.int64))
                mask[row, start:] = torch.from_numpy(request.replay_valid)
        return ids.view(-1, shape.num_layers, shape.top_k), mask.view(-1)

    def _routing(self, rows: int, width: int) -> np.ndarray | None:
        if not self.tap:
            return None
        layers = [calls[0].view(rows, width, -1) for calls in self.tap.layer_calls()]
        return torch.stack(layers, dim=2).numpy().astype(self.model.routing.id_dtype)
