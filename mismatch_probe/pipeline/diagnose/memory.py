"""Each pass's memory: its estimated peak before it runs, the device's free memory when it is about to, and its
measured peak once it ran; a pass whose estimate exceeds the free memory is skipped with why "memory" and the
option that would let it run, never left to crash.

The estimate is engines/memory.py's, the one source `probe rescore`'s out-of-memory line uses too: the weights
(parameters counted from the checkpoint's safetensors headers, at the bytes per parameter the pass holds:
engines/memory.py's `held_bytes`, where an hf fp32 pass of a bf16 checkpoint holds it as stored) plus one batch's largest tensors (`batch_bytes`: attention
scores, one LM-head chunk's logits, hidden states) at `--batch-size` sequences of the rollout's mean length.
locate holds one configuration at a time (locate/job.py): the larger side's weights, plus the activations it
captures, every hooked input of one batch on both sides. The doctor and the report read Parquet only: no estimate.

A pass that shares the checkpoint already loaded (the same configuration) needs only its batch beside it; a pass
of another configuration is checked once the loaded one is freed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.engines.memory import (
    MemoryContext,
    available_bytes,
    batch_bytes,
    checkpoint_parameters,
    device_of,
    held_bytes,
)
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json
from mismatch_probe.pipeline.diagnose.passes import END, FP32, GENERATE, LOCATE, QUANT, Pass
from mismatch_probe.pipeline.diagnose.plan import LOCATE_SAMPLES, LOCATE_WORST, locate_reference
from mismatch_probe.vocab import FP32 as FP32_DTYPE

MEMORY = "memory"  # the why of a pass whose estimate exceeds the device's free memory
LOCATE_BATCH = 4  # locate's --batch-size default (locate/job.py)
LOCATE_CAPTURES = 2 * 4  # both sides' hooked inputs per layer (block, attention, mlp, router), in float32 at most


@dataclass(kw_only=True)
class PassMemory:
    device: str  # where the pass computes: cuda:0, cpu, or auto (device_map over every GPU and the CPU)
    estimate_bytes: int | None  # None: the pass loads no model, or the checkpoint's size is unknown
    weights_bytes: int = 0  # of the estimate, the weights (resident already for a pass that shares them)
    to_fit: str = ""  # the option that would let the pass run where the estimate does not fit
    free_bytes: int | None = None  # the device's free memory when the pass was about to run
    peak_bytes: int | None = None  # measured once it ran
    peak_of: str = ""  # what peak_bytes measures (engines/peak.py)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "estimate_bytes": self.estimate_bytes,
            "free_bytes": self.free_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_of": self.peak_of,
            "to_fit": self.to_fit,
        }


@dataclass(frozen=True, kw_only=True)
class Sizes:
    params: int
    layers: int
    width: int  # the rollout's mean sequence length, prompt and response
    context: MemoryContext


def sizes(model: str | Path | None, tokens: int, samples: int, batch_size: int) -> Sizes | None:
    """The checkpoint's parameters and shapes (config.json), None where either is unknown."""
    if model is None or not Path(model).is_dir():
        return None
    params = checkpoint_parameters(Path(model))
    try:
        raw = read_json(Path(model) / "config.json")
    except ProbeError:
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if params is None:
        return None
    context = MemoryContext(
        command="diagnose",
        engine="",
        dtype="",
        device="",
        model=Path(model),
        vocab_size=int(text.get("vocab_size") or 0),
        batch_size=batch_size,
        hidden_size=int(text.get("hidden_size") or 0),
        heads=int(text.get("num_attention_heads") or 0),
    )
    width = max(1, math.ceil(tokens / max(samples, 1)))
    return Sizes(params=params, layers=int(text.get("num_hidden_layers") or 0), width=width, context=context)


def weights_bytes(s: Sizes, dtype: str, engine: str, quantized: bool = False) -> int:
    return s.params * held_bytes(s.context.model, dtype, engine=engine, quantized=quantized)


def _batch(s: Sizes, sequences: int) -> int:
    return batch_bytes(s.context, sequences, sequences * s.width, s.width)


def to_fit(engine: str, train_args: dict, name: str) -> str:
    if name == LOCATE:
        return "probe locate by hand with device_map=auto in each side's spec (e.g. --b hf:fp32:device_map=auto)"
    if engine == "megatron":
        return "--train-arg tensor_parallel=N or --train-arg expert_parallel=N under torchrun (shards over N GPUs)"
    if "device_map" in train_args:
        return "more memory: --train-arg device_map already spreads the layers over every GPU and the CPU"
    return "--train-arg device_map=auto (spreads the layers over the GPUs and the CPU)"


def pass_memory(
    p: Pass, s: Sizes | None, *, engine: str, train_args: dict, dtype: str, rollout_dtype: str
) -> PassMemory:
    """`p`'s estimate: `dtype` the matched pass's, `rollout_dtype` the rollout's (generate's, locate's side a)."""
    device = "auto" if "device_map" in train_args else device_of(EngineConfig(dtype=dtype, engine_args=train_args))
    memory = PassMemory(device=device, estimate_bytes=None)
    if s is None or p.name in END:
        return memory
    memory.to_fit = to_fit(engine, train_args, p.name)
    if p.name == LOCATE:
        b = locate_reference(engine, dtype)
        sides = (weights_bytes(s, rollout_dtype, "hf"), weights_bytes(s, FP32_DTYPE if b else dtype, engine))
        sequences = min(LOCATE_BATCH, LOCATE_WORST + LOCATE_SAMPLES)
        captures = LOCATE_CAPTURES * s.layers * sequences * s.width * s.context.hidden_size * 4
        memory.weights_bytes = max(sides)
        memory.estimate_bytes = memory.weights_bytes + captures + _batch(s, sequences)
        return memory
    own = {GENERATE: rollout_dtype, FP32: FP32_DTYPE}.get(p.name, dtype)
    memory.weights_bytes = weights_bytes(s, own, "hf" if p.name == GENERATE else engine, quantized=p.name == QUANT)
    memory.estimate_bytes = memory.weights_bytes + _batch(s, s.context.batch_size)
    return memory


def free_bytes(memory: PassMemory) -> int | None:
    """The device's free memory now; with device_map=auto, every GPU's and the CPU's together."""
    if memory.device != "auto":
        return available_bytes(memory.device)
    import torch

    known = [available_bytes(f"cuda:{i}") for i in range(torch.cuda.device_count())] + [available_bytes("cpu")]
    return sum(n for n in known if n is not None) if any(n is not None for n in known) else None


def does_not_fit(p: Pass, resident: bool) -> bool:
    """Whether `p`'s estimate exceeds the device's free memory now (`resident`: its weights are loaded already,
    shared with the pass before); records the free memory it compared against."""
    memory = p.memory
    if memory is None or memory.estimate_bytes is None:
        return False
    memory.free_bytes = free_bytes(memory)
    if memory.free_bytes is None:
        return False
    need = memory.estimate_bytes - (memory.weights_bytes if resident else 0)
    return need > memory.free_bytes


def plan_memory(passes: list[Pass], s: Sizes | None, **setting) -> None:
    for p in passes:
        p.memory = pass_memory(p, s, **setting)


def memory_why(p: Pass) -> str:
    """A pass skipped for memory: what it needs, what was free, the option that lets it run, and its command."""
    m = p.memory
    if p.why != MEMORY or m is None or m.estimate_bytes is None or m.free_bytes is None:
        return ""
    return (
        f"memory: about {m.estimate_bytes / 1e9:.2f} GB by estimate, {m.free_bytes / 1e9:.2f} GB free on {m.device}; "
        f"to fit: {m.to_fit}; {p.command}"
    )
