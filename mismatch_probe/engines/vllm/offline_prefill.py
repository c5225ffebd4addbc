"""`probe rescore --engine vllm-offline`: vLLM's `LLM` in this process scores the rollout's token ids by prefill
(`SamplingParams(prompt_logprobs=N)`), as `--engine vllm` asks a server; the LLM is built as `vllm-offline`
generate builds it, from the same options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.engines.serving.prefill import PrefillAnswer, RescaleOption, ServerPrefillEngine, prompt_rows
from mismatch_probe.engines.vllm.offline import VLLMOfflineEngine, VLLMOfflineOptions
from mismatch_probe.errors import EngineFailure

VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(frozen=True)
class VLLMOfflinePrefillOptions(VLLMOfflineOptions, RescaleOption):
    pass


class VLLMOfflinePrefillEngine(ServerPrefillEngine):
    name = "vllm-offline"
    Options = VLLMOfflinePrefillOptions
    server_class = VLLMOfflineEngine

    @property
    def where(self) -> str:
        return "vLLM LLM"

    def server_args(self, args: dict) -> dict:
        # vLLM refuses more prompt log-probs than the LLM's max_logprobs (20 by default): a rescale asks top_n
        if "max_logprobs" in args or self.top_n <= VLLM_MAX_LOGPROBS:
            return args
        return args | {"max_logprobs": self.top_n}

    def endpoint(self) -> str:
        return "LLM.generate"

    def prefill_body(self, token_ids: list[int], temperature: float, top: int) -> dict:
        return {"prompt_token_ids": token_ids, "temperature": temperature, "prompt_logprobs": top}

    def ask(self, body: dict, ready: bool = False):
        params = self.server.module.SamplingParams(
            n=1, temperature=body["temperature"], top_p=1.0, top_k=0, seed=0, max_tokens=1,
            prompt_logprobs=body["prompt_logprobs"],
        )  # fmt: skip
        outputs = self.server.llm.generate([{"prompt_token_ids": body["prompt_token_ids"]}], params, use_tqdm=False)
        if len(outputs) != 1:
            raise EngineFailure(f"{self.where} answered {len(outputs)} outputs for one prompt")
        return outputs[0]

    def map(self, fn, items: list) -> list:
        return [fn(item) for item in items]

    def parse_prefill(self, answer, token_ids: list[int], where: str) -> PrefillAnswer:
        rows = getattr(answer, "prompt_logprobs", None)
        if rows is None:
            raise EngineFailure(f"{where}: vLLM output has no prompt_logprobs")
        got = prompt_rows([[(int(k), v.logprob) for k, v in (r or {}).items()] for r in rows], token_ids, where)
        completion = answer.outputs[0] if getattr(answer, "outputs", None) else None
        if getattr(completion, "routed_experts", None) is not None:
            got.routing = np.asarray(completion.routed_experts)
        return got
