"""`sglang` inference: the `/generate` API of an SGLang server the user started.

We send token ids (the server never tokenizes), every sampling parameter explicitly (the
server's defaults come from generation_config.json), and ask for the sampled token's log-prob,
the top-1 token and, for MoE models, the routed experts of every forwarded position.
"""

from __future__ import annotations

import base64

import numpy as np

from ..errors import EngineFailure, ProbeError
from ..records import PromptRequest, SequenceRecord
from .base import SamplingParams
from .http_client import NotFound, same_model
from .server_engine import ROUTING_FLAG, ServerEngine, ServerKind, probe_dtype, sampling_seed
from .server_records import ServerOutput, sequence_record

# Server settings worth keeping in the manifest: they change numerics, routing or sampling.
RECORDED_ARGS = (
    "model_path", "dtype", "quantization", "kv_cache_dtype", "tp_size", "dp_size", "ep_size", "pp_size",
    "attention_backend", "sampling_backend", "moe_runner_backend", "moe_a2a_backend",
    "enable_return_routed_experts", "disable_radix_cache", "enable_eplb", "ep_num_redundant_experts",
    "enable_deterministic_inference", "random_seed", "disable_cuda_graph", "chunked_prefill_size",
    "speculative_algorithm", "enable_dp_attention",
)


def decode_routing(payload: str, num_hidden_layers: int, top_k: int) -> np.ndarray:
    """SGLang's `routed_experts`: base64 of little-endian int32 `[rows, num_hidden_layers, top_k]`."""
    flat = np.frombuffer(base64.b64decode(payload), dtype="<i4")
    if flat.size % (num_hidden_layers * top_k):
        raise EngineFailure(
            f"SGLang routed_experts holds {flat.size} ids, not a multiple of num_hidden_layers x top_k = "
            f"{num_hidden_layers} x {top_k}: is the server running another model than --model?"
        )
    return flat.reshape(-1, num_hidden_layers, top_k)


def parse_output(body: dict, num_hidden_layers: int, top_k: int, routing_start: int = 0) -> ServerOutput:
    """The arrays of one `/generate` answer. `routing_start` is the request's `routed_experts_start_len`."""
    meta = body.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineFailure("SGLang answer has no meta_info.output_token_logprobs (was return_logprob sent?)")
    ids = np.array([e[1] for e in entries], dtype=np.int64)
    logprob = np.array([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float64)
    out = ServerOutput(response_ids=ids, logprob=logprob, routing_start=routing_start)
    sent = list(body.get("output_ids") or [])
    if sent != ids.tolist()[: len(sent)]:
        raise EngineFailure("SGLang answer: output_ids differ from the ids in output_token_logprobs")
    tops = meta.get("output_top_logprobs")
    if tops and len(tops) == len(ids) and all(tops):
        out.top_logprob = np.array([t[0][0] for t in tops], dtype=np.float64)
        out.top_token_id = np.array([t[0][1] for t in tops], dtype=np.int64)
    if meta.get("routed_experts") and top_k:
        out.routing = decode_routing(meta["routed_experts"], num_hidden_layers, top_k)
    return out


class SGLangInferenceEngine(ServerEngine):
    name = "sglang"
    kind = ServerKind("SGLang", 30000, "python -m sglang.launch_server --model-path", "--disable-radix-cache")

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
        info, moe = self.server_info, self.model.routing.is_moe
        if moe and info.get("enable_return_routed_experts") is False:
            raise ProbeError(self._no_routing_message())
        if moe and not info.get("disable_radix_cache", True):
            self.warn(
                "SGLang radix cache is on: prompts that share a prefix reuse the routing of whichever request "
                "prefilled it first; restart with --disable-radix-cache for exact per-request routing"
            )
        if moe and (info.get("enable_eplb") or info.get("ep_num_redundant_experts")):
            self.warn(
                "SGLang EPLB / redundant experts are on: routed experts are physical ids, not the checkpoint's; "
                "restart without --enable-eplb and with --ep-num-redundant-experts 0"
            )
        if info.get("enable_deterministic_inference") is not True:
            # SGLang reads a request's sampling_seed only in deterministic mode.
            self.warn(
                f"SGLang server at {self.client.base_url} does not report --enable-deterministic-inference: it "
                "ignores sampling_seed, so the same --seed gives other samples on a rerun or a --resume"
            )

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
        prompt = [i % self.model.vocab_size for i in (1, 2, 3, 4)]
        probe = PromptRequest(sample_id=0, prompt_id=0, prompt_ids=prompt)
        body = self._request_body(probe, SamplingParams(temperature=0.0, max_new_tokens=1))
        answer = self.ready_post("/generate", body)
        if self.model.routing.is_moe and not (answer.get("meta_info") or {}).get("routed_experts"):
            raise ProbeError(self._no_routing_message())
        try:  # a shape that does not fit --model is unusable input here, not a failure mid-run
            out = parse_output(answer, self.model.num_hidden_layers, self.model.routing.top_k)
            sequence_record(probe, out, self.model, f"SGLang server at {self.client.base_url}")
        except EngineFailure as exc:
            raise ProbeError(str(exc)) from None
        if out.response_ids.size and int(out.response_ids.max()) >= self.model.vocab_size:
            raise ProbeError(
                f"SGLang server at {self.client.base_url} sampled token {int(out.response_ids.max())}, but --model "
                f"'{self.model.path}' has vocab_size {self.model.vocab_size}: the server runs another model"
            )

    def _no_routing_message(self) -> str:
        return (
            f"SGLang server at {self.client.base_url} does not return routed experts for this MoE model: "
            f"restart it with `{ROUTING_FLAG}` (SGLang >= 0.5.7)"
        )

    # ---- generation ------------------------------------------------------------------------

    def _request_body(self, request: PromptRequest, params: SamplingParams) -> dict:
        sampling = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang's "off" is -1
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "sampling_seed": sampling_seed(params, request.sample_id),
        }
        body = {
            "input_ids": list(map(int, request.prompt_ids)),
            "sampling_params": sampling,
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
        meta = answer.get("meta_info") or {}
        where = f"SGLang server at {self.client.base_url}, sample {request.sample_id}"
        if self.model.routing.is_moe and not meta.get("routed_experts"):
            raise EngineFailure(f"{where}: answer has no routed_experts ({ROUTING_FLAG} missing?)")
        out = parse_output(answer, self.model.num_hidden_layers, self.model.routing.top_k)
        return sequence_record(request, out, self.model, where), int(meta.get("cached_tokens") or 0)

    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        done = self.client.map(self._generate_one, [(r, params) for r in requests])
        self.cached_tokens += sum(cached for _, cached in done)
        return [record for record, _ in done]

    def describe(self) -> dict:
        args = {k: self.server_info[k] for k in RECORDED_ARGS if k in self.server_info}
        return {
            **self.describe_server(self.server_info.get("version"), self.model_info.get("model_path")),
            "weight_version": self.model_info.get("weight_version"),
            "server_args": args,
            "cached_tokens": self.cached_tokens,
        }
