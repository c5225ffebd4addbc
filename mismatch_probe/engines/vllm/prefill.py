"""`probe rescore --engine vllm`: a vLLM server's own prefill of the rollout's token ids (`prompt_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.engines.serving.prefill import (
    PrefillAnswer,
    PrefillOptions,
    ServerPrefillEngine,
    prompt_rows,
)
from mismatch_probe.engines.vllm.server import VLLMInferenceEngine, VLLMServerOptions, decode_routing
from mismatch_probe.errors import EngineFailure


@dataclass(frozen=True)
class VLLMPrefillOptions(PrefillOptions, VLLMServerOptions):
    pass


class VLLMPrefillEngine(ServerPrefillEngine):
    name = "vllm"
    Options = VLLMPrefillOptions
    server_class = VLLMInferenceEngine

    def endpoint(self) -> str:
        return "/v1/completions"

    def prefill_body(self, token_ids: list[int], temperature: float, top: int) -> dict:
        return {
            "model": self.server.served.get("id") or str(self.model.path),
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": 0,
            "seed": 0,
            "prompt_logprobs": top,  # the prompt token's own log-prob always comes with the top-N
            "add_special_tokens": False,
            "return_token_ids": True,
            "stream": False,
        }

    def parse_prefill(self, answer: dict, token_ids: list[int], where: str) -> PrefillAnswer:
        choices = answer.get("choices") or []
        if len(choices) != 1:
            raise EngineFailure(f"{where}: vLLM answer has {len(choices)} choices, expected 1")
        choice = choices[0]
        rows = choice.get("prompt_logprobs")
        if rows is None:
            raise EngineFailure(f"{where}: vLLM answer has no prompt_logprobs (was `prompt_logprobs` sent?)")
        pairs = [[(int(k), float(v["logprob"])) for k, v in (row or {}).items()] for row in rows]
        got = prompt_rows(pairs, token_ids, where)
        got.routing = decode_routing(choice["routed_experts"]) if choice.get("routed_experts") else None
        return got
