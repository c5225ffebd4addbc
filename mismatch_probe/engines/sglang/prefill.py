"""`probe rescore --engine sglang`: an SGLang server's own prefill of the rollout's token ids.

`return_logprob` with `logprob_start_len=0` returns `meta_info.input_token_logprobs` (`[logprob, id, text]` per
prompt position, the first `None`) and, with `top_logprobs_num`, `input_top_logprobs`; `routed_experts_start_len=0`
returns the routing of every prompt position. `cached_tokens` and `weight_version` say which path served it."""

from __future__ import annotations

import numpy as np

from mismatch_probe.engines.serving.prefill import (
    PrefillAnswer,
    PrefillOptions,
    ServerPrefillEngine,
    padded_tops,
    require_length,
)
from mismatch_probe.engines.sglang.fields import decode_routing
from mismatch_probe.engines.sglang.server import SGLangInferenceEngine
from mismatch_probe.errors import EngineFailure


def prefill_body(token_ids: list[int], temperature: float, top: int, moe: bool) -> dict:
    body = {
        "input_ids": token_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": temperature, "top_p": 1.0, "top_k": -1},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top,
        "stream": False,
    }
    if moe:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = 0
    return body


def parse_prefill(answer: dict, token_ids: list[int], layers: int, top_k: int, where: str) -> PrefillAnswer:
    """The prompt positions of one SGLang answer; its ids must be the ones sent."""
    meta = answer.get("meta_info") or {}
    n = len(token_ids)
    entries = meta.get("input_token_logprobs")
    if entries is None:
        raise EngineFailure(f"{where}: SGLang answer has no meta_info.input_token_logprobs (logprob_start_len=0?)")
    require_length(entries, n, "input_token_logprobs", where)
    if [int(e[1]) for e in entries] != token_ids:
        raise EngineFailure(f"{where}: SGLang's input_token_logprobs hold other token ids than the ones sent")
    logprob = np.array([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float64)
    tops = meta.get("input_top_logprobs") or []
    rows = [[(int(t[1]), float(t[0])) for t in row or [] if t[0] is not None] for row in tops]
    ids, lps = padded_tops(rows, n, max((len(r) for r in rows), default=1)) if rows else (None, None)
    routing = None
    if meta.get("routed_experts") and top_k:
        routing = decode_routing(meta["routed_experts"], layers, top_k)
    cached = meta.get("cached_tokens")
    return PrefillAnswer(
        logprob=logprob,
        top_ids=ids,
        top_logprobs=lps,
        routing=routing,
        cached_tokens=None if cached is None else int(cached),
        weight_version=meta.get("weight_version"),
    )


class SGLangPrefillEngine(ServerPrefillEngine):
    name = "sglang"
    Options = PrefillOptions
    server_class = SGLangInferenceEngine

    def endpoint(self) -> str:
        return "/generate"

    def prefill_body(self, token_ids: list[int], temperature: float, top: int) -> dict:
        return prefill_body(token_ids, temperature, top, self.model.routing.is_moe)

    def parse_prefill(self, answer: dict, token_ids: list[int], where: str) -> PrefillAnswer:
        return parse_prefill(answer, token_ids, self.model.num_hidden_layers, self.model.routing.top_k, where)
