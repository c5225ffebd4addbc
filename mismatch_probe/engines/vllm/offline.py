"""`vllm-offline` inference: vLLM's `LLM` class in this process, as RL frameworks drive it.

Prompts go as token ids (`{"prompt_token_ids": ...}`), one explicit `SamplingParams` per sample
with its own seed and `logprobs=1` (the sampled token's log-prob and the top-1). The LLM is built
with `logprobs_mode="processed_logprobs"` (`log_softmax(logits / T)`), which `check_ready` verifies
by measurement as the `vllm` engine does for a server. Routed experts come back in
`CompletionOutput.routed_experts` where the build supports them (vLLM's V2 model runner: GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.engines.base import SamplingParams
from mismatch_probe.engines.options import option
from mismatch_probe.engines.serving.in_process import InProcessEngine
from mismatch_probe.engines.serving.quantization import served_quantization
from mismatch_probe.engines.serving.records import ServerOutput, sequence_record
from mismatch_probe.engines.serving.server_engine import probe_dtype, sampling_seed
from mismatch_probe.engines.vllm.logprob_mode import (
    PROBE_TEMPERATURE,
    PROBE_TOP,
    RENORMALISED_WARNING,
    classify_logprobs_mode,
    renormalised,
)
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord

MODE = "processed_logprobs"


@dataclass(frozen=True)
class VLLMOfflineOptions:
    tensor_parallel_size: int = option(1, "tensor-parallel GPUs", min=1)
    gpu_memory_utilization: float = option(0.9, "GPU memory fraction vLLM may take", min=0.01)
    max_model_len: int | None = option(
        None, "longest prompt + response (vLLM's default from the config when none)", min=1
    )
    enable_prefix_caching: bool = option(False, "prefix cache; off so that every request's routing is its own")
    enforce_eager: bool = option(False, "no CUDA graphs")
    return_routed_experts: bool | None = option(
        None, "ask for routed experts (MoE models); none: when CUDA is present (needs vLLM's V2 model runner)"
    )
    quantization: str | None = option(
        None, "vLLM's weight quantization, e.g. fp8 (none: the checkpoint's own); recorded in the manifest"
    )
    kv_cache_dtype: str | None = option(None, "vLLM's KV-cache dtype, e.g. fp8_e4m3 (none: auto, the model's dtype)")
    seed: int = option(0, "vLLM's engine seed")
    max_logprobs: int | None = option(None, "vLLM's max_logprobs: the most log-probs a request may ask (none: 20)")


def completion_output(completion) -> ServerOutput:
    """The arrays of one `CompletionOutput` requested with `logprobs=1`: per position a dict
    token id -> Logprob holding the sampled token and the top-1."""
    ids = np.asarray(completion.token_ids, dtype=np.int64)
    positions = list(completion.logprobs or [])
    if len(positions) != len(ids):
        raise EngineFailure(f"vLLM output has {len(positions)} log-prob positions for {len(ids)} tokens")
    logprob = np.array([pos[token].logprob for pos, token in zip(positions, ids.tolist())], dtype=np.float64)
    best = [max(pos.items(), key=lambda item: item[1].logprob) for pos in positions]
    out = ServerOutput(response_ids=ids, logprob=logprob)
    out.top_token_id = np.array([token for token, _ in best], dtype=np.int64)
    out.top_logprob = np.array([value.logprob for _, value in best], dtype=np.float64)
    if getattr(completion, "routed_experts", None) is not None:
        out.routing = np.asarray(completion.routed_experts)
    return out


class VLLMOfflineEngine(InProcessEngine):
    name = "vllm-offline"
    Options = VLLMOfflineOptions
    package = "vllm"

    def start(self) -> None:
        self.llm = self.module.LLM(**self.settings)
        self.logprobs_mode: str | None = None
        self.routing_returned = False

    def construction_kwargs(self) -> dict:
        opts = self.options
        routing = opts.return_routed_experts
        if routing is None:
            import torch

            routing = torch.cuda.is_available()
        kwargs = {
            "model": str(self.model.path),
            "dtype": self.package_dtype,
            "seed": opts.seed,
            "logprobs_mode": MODE,
            "tensor_parallel_size": opts.tensor_parallel_size,
            "gpu_memory_utilization": opts.gpu_memory_utilization,
            "enable_prefix_caching": opts.enable_prefix_caching,
            "enforce_eager": opts.enforce_eager,
            "enable_return_routed_experts": bool(routing and self.model.routing.is_moe),
        }
        for key in ("max_model_len", "quantization", "kv_cache_dtype", "max_logprobs"):
            if getattr(opts, key) is not None:
                kwargs[key] = getattr(opts, key)
        return kwargs

    def _sampling(self, params: SamplingParams, sample_id: int, logprobs: int = 1):
        return self.module.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            min_p=0.0,
            repetition_penalty=1.0,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            seed=sampling_seed(params, sample_id),
            max_tokens=params.max_new_tokens,
            logprobs=logprobs,
        )

    def _run(self, requests: list[PromptRequest], params: SamplingParams, logprobs: int = 1) -> list:
        prompts = [{"prompt_token_ids": list(map(int, r.prompt_ids))} for r in requests]
        sampling = [self._sampling(params, r.sample_id, logprobs) for r in requests]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        if len(outputs) != len(requests) or any(len(o.outputs) != 1 for o in outputs):
            raise EngineFailure(f"vLLM answered {len(outputs)} of {len(requests)} requests, or not one completion each")
        return [o.outputs[0] for o in outputs]

    def check_ready(self, params: SamplingParams) -> None:
        probe = PromptRequest(sample_id=0, prompt_id=0, prompt_ids=[i % self.model.vocab_size for i in (1, 2, 3, 4)])
        tops = []
        for temperature in (1.0, PROBE_TEMPERATURE):
            [out] = self._run([probe], SamplingParams(temperature=temperature, max_new_tokens=1), PROBE_TOP)
            tops.append({token: value.logprob for token, value in out.logprobs[0].items()})
        self.logprobs_mode = classify_logprobs_mode(tops[0], tops[1], PROBE_TEMPERATURE)
        if self.logprobs_mode is None:
            self.warn("could not verify vLLM's logprobs_mode (next-token distribution too flat)")
        elif self.logprobs_mode != MODE:
            raise ProbeError(f"vLLM LLM returns {self.logprobs_mode} although built with logprobs_mode={MODE}")
        self._check_routing(out, probe)
        if renormalised(params):
            self.warn(RENORMALISED_WARNING)

    def _check_routing(self, completion, probe: PromptRequest) -> None:
        if not self.model.routing.is_moe:
            return
        self.routing_returned = getattr(completion, "routed_experts", None) is not None
        if not self.routing_returned:
            asked = self.settings["enable_return_routed_experts"]
            self.warn(
                "vLLM returns no routed experts: routing columns stay null ("
                + ("the build did not return them" if asked else "--engine-arg return_routed_experts=true asks")
                + "; this needs vLLM's V2 model runner, not available on CPU)"
            )
            return
        try:  # a routing shape that does not fit --model is unusable input, not a failure mid-run
            sequence_record(probe, completion_output(completion), self.model, "vLLM LLM")
        except EngineFailure as exc:
            raise ProbeError(str(exc)) from None

    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        outputs = self._run(requests, params)
        return [
            sequence_record(r, completion_output(c), self.model, f"vLLM LLM, sample {r.sample_id}")
            for r, c in zip(requests, outputs)
        ]

    def _config(self, name: str):
        """One of the LLM's resolved configs (model_config, cache_config), None where this vLLM hides it."""
        found = getattr(self.llm, name, None) or getattr(getattr(self.llm, "llm_engine", None), name, None)
        vllm_config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        return found or getattr(vllm_config, name, None)

    @property
    def dtype(self) -> str:
        return probe_dtype(getattr(self._config("model_config"), "dtype", None))

    def quantization(self) -> dict | None:
        """The LLM's resolved quantization (the checkpoint's own included) and KV-cache dtype, else as asked."""
        model, cache = self._config("model_config"), self._config("cache_config")
        weight = getattr(model, "quantization", None) if model is not None else self.options.quantization
        kv = getattr(cache, "cache_dtype", None) if cache is not None else self.options.kv_cache_dtype
        return served_quantization(weight, kv, self.model.path)

    def describe(self) -> dict:
        return {
            "engine": self.name,
            "dtype": self.dtype,
            "vllm_version": getattr(self.module, "__version__", None),
            "engine_args": dict(self.settings),
            "logprobs_mode": self.logprobs_mode,
            "routed_experts": self.routing_returned,
            "warnings": list(self.warnings),
        }
