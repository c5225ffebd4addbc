"""`sglang` inference: the `/generate` API of an SGLang server the user started.

We send token ids (the server never tokenizes), every sampling parameter explicitly (the
server's defaults come from generation_config.json), and ask for the sampled token's log-prob,
the top-1 token and, for MoE models, the routed experts of every forwarded position.
"""

from __future__ import annotations

from mismatch_probe.engines.base import SamplingParams
from mismatch_probe.engines.serving.http_client import NotFound, same_model
from mismatch_probe.engines.serving.quantization import served_quantization
from mismatch_probe.engines.serving.server_engine import ROUTING_FLAG, ServerEngine, ServerKind, probe_dtype
from mismatch_probe.engines.sglang.fields import (
    RECORDED_ARGS,
    answer_record,
    check_probe_answer,
    probe_request,
    sampling_fields,
    settings_warnings,
)
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord


def server_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class SGLangInferenceEngine(ServerEngine):
    name = "sglang"
    kind = ServerKind(
        label="SGLang",
        default_port=30000,
        launch_program="python -m sglang.launch_server --model-path",
        launch_flags="--disable-radix-cache",
    )

    def __init__(self, model, config):
        super().__init__(model, config)
        self.server_info: dict = {}
        self.model_info: dict = {}
        self.cached_tokens = 0

    # ---- readiness ------------------------------------------------------------------------

    def check_ready(self, params: SamplingParams) -> None:
        self.model_info = self._get_first("/get_model_info", "/model_info")
        self.server_info = self._get_first("/get_server_info", "/server_info", optional=True)
        served = self.model_info.get("model_path") or self.server_info.get("model_path") or ""
        if not same_model(served, self.model.path):
            raise ProbeError(
                f"SGLang server at {self.client.base_url} serves '{served}', but --model is '{self.model.path}': "
                "start the server on the same checkpoint"
            )
        self.server_dtype = probe_dtype(self.server_info.get("dtype"))
        self._check_server_args()
        self._check_probe_request()

    def _check_server_args(self) -> None:
        where = f"SGLang server at {self.client.base_url}"
        moe = self.model.routing.is_moe
        for warning in settings_warnings(self.server_info, moe, where, server_flag, self._no_routing_message()):
            self.warn(warning)

    def _get_first(self, *paths: str, optional: bool = False) -> dict:
        for path in paths:
            try:
                return self.ready_get(path)
            except NotFound:
                continue
        if optional:
            return {}
        raise ProbeError(f"{self.client.base_url} does not look like an SGLang server (no {' or '.join(paths)})")

    def _check_probe_request(self) -> None:
        """One tiny generation: the server accepts our fields and returns routing of our model's shape."""
        probe, params = probe_request(self.model)
        answer = self.ready_post("/generate", self._request_body(probe, params))
        where = f"SGLang server at {self.client.base_url}"
        check_probe_answer(answer, probe, self.model, where, self._no_routing_message())

    def _no_routing_message(self) -> str:
        return (
            f"SGLang server at {self.client.base_url} does not return routed experts for this MoE model: "
            f"restart it with `{ROUTING_FLAG}` (SGLang >= 0.5.7)"
        )

    # ---- generation ------------------------------------------------------------------------

    def _request_body(self, request: PromptRequest, params: SamplingParams) -> dict:
        body = {
            "input_ids": list(map(int, request.prompt_ids)),
            "sampling_params": sampling_fields(params, request.sample_id),
            "return_logprob": True,
            "top_logprobs_num": 1,
            "stream": False,
        }
        if self.model.routing.is_moe:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = 0
        return body

    def _generate_one(self, args: tuple[PromptRequest, SamplingParams]) -> tuple[SequenceRecord, int]:
        request, params = args
        answer = self.call_generate("/generate", self._request_body(request, params))
        where = f"SGLang server at {self.client.base_url}, sample {request.sample_id}"
        return answer_record(answer, request, self.model, where)

    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        done = self.client.map(self._generate_one, [(r, params) for r in requests])
        self.cached_tokens += sum(cached for _, cached in done)
        return [record for record, _ in done]

    def quantization(self) -> dict | None:
        """The server's `quantization` and `kv_cache_dtype` (its /get_server_info, read by check_ready)."""
        info = self.server_info
        return served_quantization(info.get("quantization"), info.get("kv_cache_dtype"), self.model.path)

    def describe(self) -> dict:
        args = {k: self.server_info[k] for k in RECORDED_ARGS if k in self.server_info}
        return {
            **self.describe_server(self.server_info.get("version"), self.model_info.get("model_path")),
            "weight_version": self.model_info.get("weight_version"),
            "server_args": args,
            "cached_tokens": self.cached_tokens,
        }
