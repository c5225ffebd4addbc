"""Turning what an inference server returned for one prompt into a SequenceRecord."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.errors import EngineFailure
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord


@dataclass
class ServerOutput:
    """One completion as the server reported it, before alignment to positions.

    `routing` is `[rows, layers, k]` for the forwards whose input tokens sit at positions
    `routing_start .. routing_start + rows - 1`; the server reports either every decoder layer
    or only the MoE layers. Missing log-probs are NaN.
    """

    response_ids: np.ndarray
    logprob: np.ndarray
    top_token_id: np.ndarray | None = None
    top_logprob: np.ndarray | None = None
    routing: np.ndarray | None = None
    routing_start: int = 0


def moe_rows(routing: np.ndarray, model: ModelInfo, where: str) -> np.ndarray:
    """Keep the MoE layers of `[rows, layers, k]` routing, as the schema's id dtype."""
    shape = model.routing
    layers, k = routing.shape[1:]
    if k != shape.top_k:
        raise EngineFailure(
            f"{where}: routed experts have top-k {k}, but --model has num_experts_per_tok {shape.top_k}"
        )
    if layers == model.num_hidden_layers:
        routing = routing[:, list(model.moe_layer_indices)]
    elif layers != shape.num_layers:
        raise EngineFailure(
            f"{where}: routed experts cover {layers} layers, but --model has {model.num_hidden_layers} layers "
            f"({shape.num_layers} MoE): is the server running another model?"
        )
    if routing.size and (routing.min() < 0 or routing.max() >= shape.num_experts):
        raise EngineFailure(
            f"{where}: routed expert id {int(routing.max())} outside 0..{shape.num_experts - 1}: "
            "the server reports physical ids (disable EPLB / redundant experts) or runs another model"
        )
    return routing.astype(shape.id_dtype)


def sequence_record(request: PromptRequest, out: ServerOutput, model: ModelInfo, where: str) -> SequenceRecord:
    prompt = np.asarray(request.prompt_ids, dtype=np.int64)
    p, r = len(prompt), len(out.response_ids)
    n = p + r
    response = np.arange(n) >= p

    def pad(values: np.ndarray, dtype) -> np.ndarray:
        return np.concatenate([np.zeros(p, dtype), np.asarray(values, dtype=dtype)])

    logprob = pad(np.nan_to_num(out.logprob, nan=0.0), np.float32)
    record = SequenceRecord(
        sample_id=request.sample_id,
        prompt_id=request.prompt_id,
        token_ids=np.concatenate([prompt, np.asarray(out.response_ids, dtype=np.int64)]),
        prompt_len=p,
        logprob=logprob,
        logprob_valid=response & pad(~np.isnan(out.logprob), bool),
    )
    if out.top_token_id is not None:
        record.top_token_id = pad(out.top_token_id, np.int64)
        record.top_logprob = pad(out.top_logprob, np.float32)
    if out.routing is not None and model.routing.is_moe:
        rows = out.routing.shape[0]
        # The last sampled token is never forwarded, so routing ends one position short.
        if out.routing_start + rows != n - 1:
            raise EngineFailure(
                f"{where}: routed experts cover {rows} positions from {out.routing_start}, expected "
                f"{n - 1 - out.routing_start} (prompt {p} + response {r} - 1 - start {out.routing_start})"
            )
        shape = model.routing
        record.experts = np.zeros((n, shape.num_layers, shape.top_k), dtype=shape.id_dtype)
        record.experts[out.routing_start : n - 1] = moe_rows(out.routing, model, where)
        record.experts_valid = np.zeros(n, dtype=bool)
        record.experts_valid[out.routing_start : n - 1] = True
    return record
