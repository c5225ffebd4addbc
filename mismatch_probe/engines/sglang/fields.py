"""What SGLang's HTTP `/generate` and its in-process `sglang.Engine.generate` share: the fields the
probe sends with every request, the answer dicts both return (`output_ids` + `meta_info`), and the
checks on the settings both report (the server's `/get_server_info`, the Engine's `server_args`).
"""

from __future__ import annotations

import base64
from collections.abc import Callable

import numpy as np

from mismatch_probe.engines.base import SamplingParams
from mismatch_probe.engines.serving.records import ServerOutput, sequence_record
from mismatch_probe.engines.serving.server_engine import ROUTING_FLAG, sampling_seed
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord

# Settings worth keeping in the manifest: they change numerics, routing or sampling.
RECORDED_ARGS = (
    "model_path",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tp_size",
    "dp_size",
    "ep_size",
    "pp_size",
    "attention_backend",
    "sampling_backend",
    "moe_runner_backend",
    "moe_a2a_backend",
    "enable_return_routed_experts",
    "disable_radix_cache",
    "enable_eplb",
    "ep_num_redundant_experts",
    "enable_deterministic_inference",
    "random_seed",
    "disable_cuda_graph",
    "chunked_prefill_size",
    "speculative_algorithm",
    "enable_dp_attention",
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
    """The arrays of one answer. `routing_start` is the request's `routed_experts_start_len`."""
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


def sampling_fields(params: SamplingParams, sample_id: int) -> dict:
    """Every sampling parameter, explicit: SGLang's defaults come from the checkpoint's generation_config.json."""
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang's "off" is -1
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "sampling_seed": sampling_seed(params, sample_id),
    }


def answer_record(answer: dict, request: PromptRequest, model: ModelInfo, where: str) -> tuple[SequenceRecord, int]:
    """One answer as a record, with the prefix-cache hits SGLang reported for it."""
    meta = answer.get("meta_info") or {}
    if model.routing.is_moe and not meta.get("routed_experts"):
        raise EngineFailure(f"{where}: answer has no routed_experts ({ROUTING_FLAG} missing?)")
    out = parse_output(answer, model.num_hidden_layers, model.routing.top_k)
    record = sequence_record(request, out, model, where)
    cached, version = meta.get("cached_tokens"), meta.get("weight_version")
    record.cached_tokens = None if cached is None else int(cached)
    record.weight_version = None if version is None else str(version)
    return record, int(cached or 0)


def probe_request(model: ModelInfo) -> tuple[PromptRequest, SamplingParams]:
    """The readiness check's one tiny greedy generation."""
    prompt = [i % model.vocab_size for i in (1, 2, 3, 4)]
    return PromptRequest(sample_id=0, prompt_id=0, prompt_ids=prompt), SamplingParams(temperature=0.0, max_new_tokens=1)


def check_probe_answer(answer: dict, request: PromptRequest, model: ModelInfo, where: str, no_routing: str) -> None:
    """SGLang accepted our fields and answered with routing of our model's shape and ids in its vocabulary."""
    if model.routing.is_moe and not (answer.get("meta_info") or {}).get("routed_experts"):
        raise ProbeError(no_routing)
    try:  # a shape that does not fit --model is unusable input here, not a failure mid-run
        out = parse_output(answer, model.num_hidden_layers, model.routing.top_k)
        sequence_record(request, out, model, where)
    except EngineFailure as exc:
        raise ProbeError(str(exc)) from None
    if out.response_ids.size and int(out.response_ids.max()) >= model.vocab_size:
        raise ProbeError(
            f"{where} sampled token {int(out.response_ids.max())}, but --model '{model.path}' has vocab_size "
            f"{model.vocab_size}: it runs another model"
        )


def settings_warnings(info: dict, moe: bool, where: str, flag: Callable[[str], str], no_routing: str) -> list[str]:
    """Warnings about SGLang settings that make samples or routing inexact; `flag(name)` spells the
    setting (a server flag, an engine option). Refuses an MoE model whose routing is switched off."""
    warnings = []
    if moe and info.get("enable_return_routed_experts") is False:
        raise ProbeError(no_routing)
    if moe and not info.get("disable_radix_cache", True):
        warnings.append(
            "SGLang radix cache is on: prompts that share a prefix reuse the routing of whichever request "
            f"prefilled it first; set {flag('disable_radix_cache')} for exact per-request routing"
        )
    if moe and (info.get("enable_eplb") or info.get("ep_num_redundant_experts")):
        warnings.append(
            "SGLang EPLB / redundant experts are on: routed experts are physical ids, not the checkpoint's; "
            f"turn off {flag('enable_eplb')} and set {flag('ep_num_redundant_experts')} 0"
        )
    if info.get("enable_deterministic_inference") is not True:
        # SGLang reads a request's sampling_seed only in deterministic mode.
        warnings.append(
            f"{where} does not report {flag('enable_deterministic_inference')}: it ignores "
            "sampling_seed, so the same --seed gives other samples on a rerun or a --resume"
        )
    return warnings
