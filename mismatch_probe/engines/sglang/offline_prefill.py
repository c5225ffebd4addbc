"""`probe rescore --engine sglang-offline`: SGLang's `sglang.Engine` in this process scores the rollout's token ids
by prefill, as `--engine sglang` asks a server. The Engine is built as `sglang-offline` generate builds it, from
the same options; `Engine.generate` takes the server's `/generate` fields as keywords and answers with the same
`meta_info` (`input_token_logprobs`, `input_top_logprobs`), so requests and answers are the `sglang` prefill's."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.engines.serving.prefill import RescaleOption
from mismatch_probe.engines.sglang.offline import SGLangOfflineEngine, SGLangOfflineOptions
from mismatch_probe.engines.sglang.prefill import SGLangPrefillEngine
from mismatch_probe.errors import EngineFailure


@dataclass(frozen=True)
class SGLangOfflinePrefillOptions(SGLangOfflineOptions, RescaleOption):
    pass


class SGLangOfflinePrefillEngine(SGLangPrefillEngine):
    name = "sglang-offline"
    Options = SGLangOfflinePrefillOptions
    server_class = SGLangOfflineEngine

    @property
    def where(self) -> str:
        return "SGLang Engine"

    def endpoint(self) -> str:
        return "Engine.generate"

    def ask(self, body: dict, ready: bool = False) -> dict:
        # one request in the batched form generate uses (a list of id lists, one sampling dict each)
        request = body | {"input_ids": [body["input_ids"]], "sampling_params": [body["sampling_params"]]}
        answers = self.server.engine_generate(**request)
        if len(answers) != 1:
            raise EngineFailure(f"{self.where} answered {len(answers)} requests for one prompt")
        return answers[0]

    def map(self, fn, items: list) -> list:
        return [fn(item) for item in items]
