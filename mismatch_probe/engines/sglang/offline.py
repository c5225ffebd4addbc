"""`sglang-offline` inference: SGLang's `sglang.Engine` in this process, as RL frameworks drive it.

The Engine answers with the same dicts as the HTTP `/generate` (`output_ids` + `meta_info`), so
requests and answers go through the same code as the `sglang` engine (engines/sglang/fields.py):
token ids in, every sampling parameter explicit, the sampled token's log-prob, the top-1 and, for
MoE models, the routed experts of every forwarded position. Routing capture is switched on for MoE
models whatever the options say.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mismatch_probe.engines.base import SamplingParams
from mismatch_probe.engines.options import option
from mismatch_probe.engines.serving.in_process import InProcessEngine
from mismatch_probe.engines.serving.quantization import served_quantization
from mismatch_probe.engines.serving.server_engine import probe_dtype
from mismatch_probe.engines.sglang.death import EngineDeath
from mismatch_probe.engines.sglang.fields import (
    RECORDED_ARGS,
    answer_record,
    check_probe_answer,
    probe_request,
    sampling_fields,
    settings_warnings,
)
from mismatch_probe.engines.sglang.start import CPU_SETTINGS, start_failure
from mismatch_probe.errors import EngineFailure
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord


@dataclass(frozen=True)
class SGLangOfflineOptions:
    tp_size: int = option(1, "tensor-parallel size (GPUs per engine)", min=1)
    dp_size: int = option(1, "data-parallel replicas", min=1)
    ep_size: int = option(1, "expert-parallel size", min=1)
    mem_fraction_static: float | None = option(
        None, "GPU memory fraction for weights + KV cache (SGLang's default when none)", min=0.01
    )
    attention_backend: str | None = option(None, "SGLang attention backend (its default when none)")
    disable_radix_cache: bool = option(True, "no prefix cache, so every request's routing is its own")
    enable_deterministic_inference: bool = option(
        True, "batch-invariant kernels; SGLang honours sampling_seed only with it"
    )
    quantization: str | None = option(
        None, "SGLang's weight quantization, e.g. fp8 (none: the checkpoint's own; recorded in the manifest)"
    )
    kv_cache_dtype: str | None = option(
        None, "SGLang's KV-cache dtype, e.g. fp8_e4m3 (none: SGLang's auto, the model's dtype)"
    )
    random_seed: int = option(0, "SGLang's own random seed")
    log_level: str = option("error", "SGLang's log level")


def engine_flag(name: str) -> str:
    return f"--engine-arg {name}"


def server_settings(args) -> dict:
    """SGLang's settings object as a dict, read through its own API. ServerArgs is a msgspec.Struct
    in SGLang 0.5.23 (`vars()` of it is empty) whose `resolved_dict()` gives the values the Engine
    runs with; older SGLang had a dataclass."""
    if hasattr(args, "resolved_dict"):
        return dict(args.resolved_dict())
    if hasattr(type(args), "__struct_fields__"):
        import msgspec  # SGLang's own dependency

        return msgspec.structs.asdict(args)
    if dataclasses.is_dataclass(args):
        return {field.name: getattr(args, field.name) for field in dataclasses.fields(args)}
    return dict(vars(args))


class SGLangOfflineEngine(InProcessEngine):
    name = "sglang-offline"
    Options = SGLangOfflineOptions
    package = "sglang"
    writes_serving_path = True  # its answers' meta_info, as the server's
    help_note = f"Settings known to work on CPU (SGLang's CPU build): {CPU_SETTINGS}"

    def start(self) -> None:
        self.version = getattr(self.module, "__version__", None)
        self.cached_tokens = 0
        self.death = EngineDeath()
        try:
            self.engine = self.module.Engine(**self.settings, custom_sigquit_handler=self.death.on_start_sigquit)
        except EngineFailure:
            raise
        except Exception as exc:  # SGLang's settings checks and start-up errors: one line, not a traceback
            raise start_failure(exc, self.version) from exc
        self.death.watch(self.engine)
        self.server_settings = server_settings(self.engine.server_args)

    def construction_kwargs(self) -> dict:
        options = {k: v for k, v in dataclasses.asdict(self.options).items() if v is not None}
        kwargs = {"model_path": str(self.model.path), "dtype": self.package_dtype, **options}
        if self.model.routing.is_moe:
            kwargs["enable_return_routed_experts"] = True
        return kwargs

    def check_ready(self, params: SamplingParams) -> None:
        where = "SGLang Engine"
        no_routing = f"{where} does not return routed experts for this MoE model (SGLang >= 0.5.7 needed)"
        moe = self.model.routing.is_moe
        for warning in settings_warnings(self.server_settings, moe, where, engine_flag, no_routing):
            self.warn(warning)
        probe, probe_params = probe_request(self.model)
        [answer] = self._call([probe], probe_params)
        check_probe_answer(answer, probe, self.model, where, no_routing)

    def _call(self, requests: list[PromptRequest], params: SamplingParams) -> list[dict]:
        return self.engine_generate(
            input_ids=[list(map(int, r.prompt_ids)) for r in requests],
            sampling_params=[sampling_fields(params, r.sample_id) for r in requests],
            return_logprob=True,
            logprob_start_len=-1,  # output tokens only: no prompt log-probs computed
            top_logprobs_num=1,
            return_routed_experts=self.model.routing.is_moe,
            routed_experts_start_len=0,
        )

    def engine_generate(self, **request) -> list[dict]:
        """`Engine.generate(**request)`'s answers, a list; a dead child process named rather than waited on."""
        self.death.raise_if_died(self.engine)
        try:
            answers = self.engine.generate(**request)
        except Exception:
            self.death.raise_if_died(self.engine)  # the error of a request cut short by a dead child
            raise
        return answers if isinstance(answers, list) else [answers]

    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        answers = self._call(requests, params)
        if len(answers) != len(requests):
            raise EngineFailure(f"SGLang Engine answered {len(answers)} of {len(requests)} requests")
        done = [
            answer_record(a, r, self.model, f"SGLang Engine, sample {r.sample_id}") for a, r in zip(answers, requests)
        ]
        self.cached_tokens += sum(cached for _, cached in done)
        return [record for record, _ in done]

    @property
    def dtype(self) -> str:
        return probe_dtype(self.server_settings.get("dtype"))

    def quantization(self) -> dict | None:
        """The Engine's own `quantization` and `kv_cache_dtype`, as its ServerArgs resolved them."""
        args = self.server_settings
        return served_quantization(args.get("quantization"), args.get("kv_cache_dtype"), self.model.path)

    def describe(self) -> dict:
        args = self.server_settings
        return {
            "engine": self.name,
            "dtype": self.dtype,
            "sglang_version": self.version,
            "engine_args": {k: args[k] for k in RECORDED_ARGS if k in args},
            "warnings": list(self.warnings),
            "cached_tokens": self.cached_tokens,
        }

    def close(self) -> None:
        self.engine.shutdown()
