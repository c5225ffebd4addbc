"""`vllm` inference: the OpenAI-compatible `/v1/completions` API of a vLLM server the user started.

Prompts go as token ids (the server never tokenizes) with every sampling parameter explicit.
vLLM's log-probs must be `log_softmax(logits / T)`, which only `--logprobs-mode
processed_logprobs` gives; the server does not publish its mode, so `check_ready` measures it:
the gaps between the top log-probs of one position scale by 1/T only in the processed modes.
Routed experts come back where the build supports them (`--enable-return-routed-experts`).
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass

import numpy as np

from mismatch_probe.engines.base import SamplingParams
from mismatch_probe.engines.options import option
from mismatch_probe.engines.serving.http_client import NotFound, same_model
from mismatch_probe.engines.serving.quantization import kv_scheme, served_quantization, weight_scheme
from mismatch_probe.engines.serving.records import ServerOutput, sequence_record
from mismatch_probe.engines.serving.server_engine import (
    ROUTING_FLAG,
    ServerEngine,
    ServerKind,
    ServerOptions,
    probe_dtype,
    sampling_seed,
)
from mismatch_probe.engines.vllm.logprob_mode import (
    PROBE_TEMPERATURE,
    PROBE_TOP,
    RENORMALISED_WARNING,
    classify_logprobs_mode,
    renormalised,
)
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord

MODE_FLAG = "--logprobs-mode processed_logprobs"


def decode_routing(payload: str) -> np.ndarray:
    """vLLM's `routed_experts`: base64 of a `.npy` file, `[num_tokens - 1, layers, k]`."""
    return np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids, vLLM spells every token "token_id:<id>".
    if not token.startswith("token_id:"):
        raise EngineFailure(f"vLLM answer: token '{token}' is not in 'token_id:<id>' form")
    return int(token.split(":", 1)[1])


def parse_choice(choice: dict, routing_start: int = 0) -> ServerOutput:
    """The arrays of one `/v1/completions` choice (requested with logprobs and token ids)."""
    lp = choice.get("logprobs")
    if not lp or lp.get("token_logprobs") is None:
        raise EngineFailure("vLLM answer has no logprobs (was `logprobs` sent?)")
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(t) for t in lp["tokens"]]
    logprob = np.array([np.nan if v is None else v for v in lp["token_logprobs"]], dtype=np.float64)
    out = ServerOutput(response_ids=np.asarray(ids, dtype=np.int64), logprob=logprob, routing_start=routing_start)
    tops = lp.get("top_logprobs")
    if tops and len(tops) == len(ids) and all(tops):
        best = [max(t.items(), key=lambda item: item[1]) for t in tops]
        out.top_token_id = np.array([_token_id(token) for token, _ in best], dtype=np.int64)
        out.top_logprob = np.array([value for _, value in best], dtype=np.float64)
    if choice.get("routed_experts"):
        out.routing = decode_routing(choice["routed_experts"])
    return out


def served_dtype(server_info: dict) -> str:
    """The model dtype from vLLM's `/server_info` (served only with VLLM_SERVER_DEV_MODE=1), else "unknown"."""
    config = server_info.get("vllm_config")
    if isinstance(config, dict):
        return probe_dtype((config.get("model_config") or {}).get("dtype"))
    found = re.search(r"\bdtype=(?:torch\.)?(\w+)", config or "")  # the text form: "..., dtype=torch.bfloat16, ..."
    return probe_dtype(found.group(1) if found else None)


QUANT_SETTINGS = (("quantization", "model_config", "quantization"), ("kv_cache_dtype", "cache_config", "cache_dtype"))
SCHEME = {"quantization": weight_scheme, "kv_cache_dtype": kv_scheme}  # a setting's value, normalised


def served_settings(server_info: dict) -> dict:
    """`quantization` and `kv_cache_dtype` as `/server_info` reports them (None: not quantized), each only where
    it does: the JSON form's model_config.quantization and cache_config.cache_dtype, the text form's
    `quantization=fp8, ... kv_cache_dtype=auto`."""
    config = server_info.get("vllm_config")
    found = {}
    for key, section, name in QUANT_SETTINGS:
        if isinstance(config, dict) and isinstance(config.get(section), dict) and name in config[section]:
            found[key] = config[section][name]
        elif isinstance(config, str):
            match = re.search(rf"\b{key}=([^,\s]*)", config)
            if match:
                found[key] = None if match.group(1) == "None" else match.group(1)
    return found


@dataclass(frozen=True)
class VLLMServerOptions(ServerOptions):
    quantization: str | None = option(
        None,
        "the server's --quantization (e.g. fp8), recorded in the manifest where its /server_info does not say "
        "(served only with VLLM_SERVER_DEV_MODE=1); a value it contradicts is refused",
    )
    kv_cache_dtype: str | None = option(
        None, "the server's --kv-cache-dtype (e.g. fp8_e4m3), recorded likewise; none or auto: not quantized"
    )


class VLLMInferenceEngine(ServerEngine):
    name = "vllm"
    kind = ServerKind(
        label="vLLM",
        default_port=8000,
        launch_program="python -m vllm.entrypoints.openai.api_server --model",
        launch_flags=MODE_FLAG,
    )

    Options = VLLMServerOptions

    def __init__(self, model, config):
        super().__init__(model, config)
        self.served: dict = {}
        self.served_settings: dict = {}  # quantization and kv_cache_dtype, where /server_info reports them
        self.version: str | None = None
        self.logprobs_mode: str | None = None
        self.routing_returned = False

    # ---- readiness ------------------------------------------------------------------------

    def check_ready(self, params: SamplingParams) -> None:
        try:
            models = self.ready_get("/v1/models").get("data") or []
        except NotFound:
            raise ProbeError(f"{self.client.base_url} does not look like a vLLM server (no /v1/models)") from None
        if not models:
            raise ProbeError(f"vLLM server at {self.client.base_url} serves no model")
        self.served = models[0]
        served_path = self.served.get("root") or self.served.get("id") or ""
        if not (same_model(served_path, self.model.path) or same_model(self.served.get("id", ""), self.model.path)):
            raise ProbeError(
                f"vLLM server at {self.client.base_url} serves '{served_path}', but --model is '{self.model.path}': "
                "start the server on the same checkpoint"
            )
        self.version = self._optional_get("/version").get("version")
        server_info = self._optional_get("/server_info?config_format=json")
        self.server_dtype = served_dtype(server_info)
        self.served_settings = served_settings(server_info)
        self._check_declared_settings()
        self._check_logprobs_mode()
        if renormalised(params):
            self.warn(RENORMALISED_WARNING)

    def _check_declared_settings(self) -> None:
        """An --engine-arg quantization or kv_cache_dtype the server's own report contradicts is a wrong record."""
        for key, _, _ in QUANT_SETTINGS:
            declared = getattr(self.options, key)
            if declared is None or key not in self.served_settings:
                continue
            served = self.served_settings[key]
            if SCHEME[key](declared) != SCHEME[key](served):
                raise ProbeError(
                    f"--engine-arg {key}={declared}: the vLLM server at {self.client.base_url} reports {key} "
                    f"{served}; drop the option (the server's own setting is recorded)"
                )

    def quantization(self) -> dict | None:
        """The server's quantization and KV-cache dtype where its /server_info reports them, else as declared
        with --engine-arg quantization=... kv_cache_dtype=... (the server is not asked otherwise)."""
        settings = {key: getattr(self.options, key) for key, _, _ in QUANT_SETTINGS} | self.served_settings
        return served_quantization(settings["quantization"], settings["kv_cache_dtype"], self.model.path)

    def _probe_request(self, temperature: float) -> dict:
        prompt = [i % self.model.vocab_size for i in (1, 2, 3, 4)]
        body = self._request_body(
            PromptRequest(sample_id=0, prompt_id=0, prompt_ids=prompt),
            SamplingParams(temperature=temperature, max_new_tokens=1),
        )
        body["logprobs"] = PROBE_TOP
        return self.ready_post("/v1/completions", body)["choices"][0]

    def _check_logprobs_mode(self) -> None:
        at_one = self._probe_request(1.0)
        at_t = self._probe_request(PROBE_TEMPERATURE)
        self.logprobs_mode = classify_logprobs_mode(
            at_one["logprobs"]["top_logprobs"][0], at_t["logprobs"]["top_logprobs"][0], PROBE_TEMPERATURE
        )
        if self.logprobs_mode is None:
            self.warn(
                "could not tell vLLM's --logprobs-mode from its answers (next-token distribution too flat); "
                f"make sure the server runs with `{MODE_FLAG}`"
            )
        elif self.logprobs_mode != "processed_logprobs":
            raise ProbeError(
                f"vLLM server at {self.client.base_url} returns {self.logprobs_mode}, not log_softmax(logits / T): "
                f"restart it with `{MODE_FLAG}`"
            )
        self.routing_returned = bool(at_one.get("routed_experts"))
        if self.model.routing.is_moe and not self.routing_returned:
            self.warn(
                f"vLLM server at {self.client.base_url} returns no routed experts: routing columns stay null "
                f"(start it with `{ROUTING_FLAG}`; this needs vLLM's V2 model runner, not available on CPU)"
            )
        if self.routing_returned:
            # The API does not publish these settings, so the advice is given every time.
            self.warn(
                "vLLM returns routed experts: prompts that share cached prefix blocks reuse the routing recorded "
                "when the block was first computed; start the server with --no-enable-prefix-caching and without "
                "--enable-eplb for exact per-request routing"
            )
            try:  # a routing shape that does not fit --model means another model
                out = parse_choice(at_one)
                sequence_record(
                    PromptRequest(sample_id=0, prompt_id=0, prompt_ids=[0] * 4),
                    out,
                    self.model,
                    f"vLLM server at {self.client.base_url}",
                )
            except EngineFailure as exc:
                raise ProbeError(str(exc)) from None

    def _optional_get(self, path: str) -> dict:
        try:
            return self.ready_get(path)
        except EngineFailure:  # NotFound included: an older or non-dev-mode server
            return {}

    # ---- generation ------------------------------------------------------------------------

    def _request_body(self, request: PromptRequest, params: SamplingParams) -> dict:
        return {
            "model": self.served.get("id") or str(self.model.path),
            "prompt": list(map(int, request.prompt_ids)),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "seed": sampling_seed(params, request.sample_id),
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "add_special_tokens": False,
            "stream": False,
        }

    def _generate_one(self, args: tuple[PromptRequest, SamplingParams]) -> SequenceRecord:
        request, params = args
        answer = self.call_generate("/v1/completions", self._request_body(request, params))
        choices = answer.get("choices") or []
        if len(choices) != 1:
            raise EngineFailure(f"vLLM answer for sample {request.sample_id} has {len(choices)} choices, expected 1")
        out = parse_choice(choices[0])
        where = f"vLLM server at {self.client.base_url}, sample {request.sample_id}"
        record = sequence_record(request, out, self.model, where)
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:  # with --enable-prompt-tokens-details
            record.cached_tokens = int(details["cached_tokens"])
        return record

    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        return self.client.map(self._generate_one, [(r, params) for r in requests])

    def describe(self) -> dict:
        return {
            **self.describe_server(self.version, self.served.get("root") or self.served.get("id")),
            "max_model_len": self.served.get("max_model_len"),
            "logprobs_mode": self.logprobs_mode,
            "routed_experts": self.routing_returned,
        }
