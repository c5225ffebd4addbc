"""Engine registry: a name maps to the class that implements it, imported only when used.

One subpackage per backend: hf/, megatron/, sglang/, vllm/, each holding its engines (a server engine
and an in-process one are separate modules of the same backend) and what only that backend needs.
What several backends share sits beside them: serving/ (the sglang and vllm engines: HTTP client,
server base, in-process base, records), forward/ (every torch forward: log-probs, host copy, weight
fingerprint, scoring contract). This root keeps the registry, the protocols (base), and the options
machinery (options, cli_args, extras, weight_files).

A new engine is one module in its backend's subpackage (the engine class with its `Options` dataclass)
plus one line here. An in-process engine never imports a server engine's module (nor the reverse):
what both need lives in a module of their own (vllm/logprob_mode.py, sglang/fields.py).
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import import_module
from typing import TYPE_CHECKING

from mismatch_probe.engines.base import EngineConfig, InferenceEngine, TrainingEngine
from mismatch_probe.engines.memory import context, loading
from mismatch_probe.engines.options import build_options
from mismatch_probe.errors import ProbeError

if TYPE_CHECKING:  # modelinfo imports torch through the MoE adapters; `probe report` never needs it
    from mismatch_probe.model.routing_shape import ModelInfo

INFERENCE = {
    "hf": "mismatch_probe.engines.hf.inference:HFInferenceEngine",
    "sglang": "mismatch_probe.engines.sglang.server:SGLangInferenceEngine",
    "vllm": "mismatch_probe.engines.vllm.server:VLLMInferenceEngine",
    "sglang-offline": "mismatch_probe.engines.sglang.offline:SGLangOfflineEngine",
    "vllm-offline": "mismatch_probe.engines.vllm.offline:VLLMOfflineEngine",
}
TRAINING = {
    "hf": "mismatch_probe.engines.hf.training:HFTrainingEngine",
    "megatron": "mismatch_probe.engines.megatron.training:MegatronTrainingEngine",
    # the inference engine's own prefill of the rollout (a diagnostic score set: decode against prefill)
    "sglang": "mismatch_probe.engines.sglang.prefill:SGLangPrefillEngine",
    "vllm": "mismatch_probe.engines.vllm.prefill:VLLMPrefillEngine",
    "sglang-offline": "mismatch_probe.engines.sglang.offline_prefill:SGLangOfflinePrefillEngine",
    "vllm-offline": "mismatch_probe.engines.vllm.offline_prefill:VLLMOfflinePrefillEngine",
}
PREFILL_ENGINES = ("sglang", "vllm", "sglang-offline", "vllm-offline")
KINDS = {"inference": INFERENCE, "training": TRAINING}


def engine_class(kind: str, name: str) -> type:
    table = KINDS[kind]
    if name not in table:
        raise ProbeError(f"--engine: unknown {kind} engine '{name}' (choose from: {', '.join(table)})")
    module, cls = table[name].split(":")
    return getattr(import_module(module), cls)


def check_engine_args(kind: str, name: str, engine_args: dict) -> None:
    """Fail before any work when the engine does not take these options (exit 2, naming the key)."""
    build_options(engine_class(kind, name).Options, name, engine_args)


def resolved_options(kind: str, name: str, engine_args: dict) -> dict:
    """Every option of the engine, the given ones converted and the rest at their defaults, as manifests record
    them (`engine_options`): two configurations that resolve alike compute alike, however they were spelled."""
    return asdict(build_options(engine_class(kind, name).Options, name, engine_args))


def inference_engine(name: str, model: ModelInfo, config: EngineConfig, command: str = "generate") -> InferenceEngine:
    """The engine, loaded; out of memory while loading is one line naming what would fit (memory.py)."""
    cls = engine_class("inference", name)
    with loading(context(command, name, model, config)):
        return cls(model, config)


def training_engine(name: str, model: ModelInfo, config: EngineConfig, command: str = "rescore") -> TrainingEngine:
    """The engine, loaded; out of memory while loading is one line naming what would fit (memory.py)."""
    cls = engine_class("training", name)
    with loading(context(command, name, model, config)):
        return cls(model, config)
