"""Engine registry: a name maps to the module that implements it, imported only when used."""

from __future__ import annotations

from importlib import import_module

from ..errors import ProbeError
from ..modelinfo import ModelInfo
from .base import EngineConfig, InferenceEngine, TrainingEngine

INFERENCE = {
    "hf": "mismatch_probe.engines.hf_inference:HFInferenceEngine",
    "sglang": "mismatch_probe.engines.sglang_inference:SGLangInferenceEngine",
    "vllm": "mismatch_probe.engines.vllm_inference:VLLMInferenceEngine",
}
TRAINING = {
    "hf": "mismatch_probe.engines.hf_training:HFTrainingEngine",
    "megatron": "mismatch_probe.engines.megatron_training:MegatronTrainingEngine",
}


def _load(table: dict[str, str], kind: str, name: str):
    if name not in table:
        raise ProbeError(f"unknown {kind} engine '{name}' (choose from: {', '.join(table)})")
    module, cls = table[name].split(":")
    return getattr(import_module(module), cls)


def inference_engine(name: str, model: ModelInfo, config: EngineConfig) -> InferenceEngine:
    return _load(INFERENCE, "inference", name)(model, config)


def training_engine(name: str, model: ModelInfo, config: EngineConfig) -> TrainingEngine:
    return _load(TRAINING, "training", name)(model, config)
