"""An engine configuration as `probe locate` takes it: ENGINE:DTYPE[:KEY=VALUE[,KEY=VALUE...]].

hf and megatron run with hooks (megatron: the megatron training engine's megatron-core model, TP = EP = 1, in
this process). The keys are locate's own, `model` (another checkpoint), and every `--engine-arg` of that engine's
training engine (its `Options`: for hf device, device_map, the quantization weight_quant, weight_quant_skip,
act_quant, kv_quant, quant_compute and the knobs attn_implementation, lm_head_dtype, router_dtype; whatever it gains later),
checked by the engine's own options code and applied by the engine's own loading code. Two keys make no sense
here and are refused: `logprob_chunk` (locate takes the logits at the chosen positions, no log-probs) and, for
megatron, a `tensor_parallel` or `expert_parallel` other than 1 (locate hooks one process). Any other key is an
error naming it: a knob silently ignored would locate a difference that is not there."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from mismatch_probe.errors import ProbeError, first_line
from mismatch_probe.vocab import DTYPE_ALIASES, DTYPES

ENGINES = ("hf", "megatron")  # the engines probe locate hooks; sglang and vllm give no hooks
HOOKED = ENGINES
OWN = {"hf": ("model",), "megatron": ("model",)}  # locate's keys; the rest are the engine's
REFUSED = {"logprob_chunk": "locate takes the logits at the chosen positions, not chunked log-probs"}
ONE_PROCESS = ("tensor_parallel", "expert_parallel")  # megatron: locate hooks the model in this one process
FORM = "ENGINE:DTYPE[:KEY=VALUE,...], e.g. hf:fp32 or hf:bf16:model=ckpt/,attn_implementation=eager"


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    dtype: str
    model: Path | None = None  # None: the run's model
    engine_args: tuple[tuple[str, str], ...] = ()  # the training engine's options, as given (checked)

    def text(self) -> str:
        keys = [f"{key}={getattr(self, key)}" for key in OWN["hf"] if getattr(self, key) is not None]
        keys += [f"{key}={value}" for key, value in self.engine_args]
        return f"{self.engine}:{self.dtype}" + (":" + ",".join(keys) if keys else "")

    def with_model(self, model: Path) -> EngineSpec:
        """The spec with the run's model filled in where it names none."""
        return self if self.model is not None else replace(self, model=Path(model))

    def options(self):
        """The engine's options dataclass built from engine_args (its defaults where none are given)."""
        return build_engine_options(self.engine, dict(self.engine_args))


def training_options_class(engine: str) -> type:
    from mismatch_probe.engines import engine_class

    return engine_class("training", engine).Options


def build_engine_options(engine: str, args: dict):
    from mismatch_probe.engines.options import build_options

    return build_options(training_options_class(engine), engine, args)


def parse_spec(text: str, flag: str) -> EngineSpec:
    """`text` as given to `flag` (--a, --b); ProbeError (exit 2) with one line naming what is wrong."""
    parts = text.split(":", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ProbeError(f"{flag}: '{text}' is not {FORM}")
    engine, dtype = parts[0].lower(), DTYPE_ALIASES.get(parts[1].lower(), parts[1].lower())
    if engine not in ENGINES:
        raise ProbeError(f"{flag}: engine '{parts[0]}' is not one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise ProbeError(f"{flag}: dtype '{parts[1]}' is not one of {', '.join(DTYPES)}")
    keys = _keys(parts[2], flag) if len(parts) == 3 else {}
    if engine != "hf" and "attn_implementation" in keys:
        raise ProbeError(f"{flag}: key 'attn_implementation' applies to hf only; {engine} takes model=PATH")
    own = {key: keys.pop(key) for key in OWN[engine] if key in keys}
    _check_engine_args(engine, keys, flag)
    model = own.pop("model", None)
    return EngineSpec(
        engine=engine,
        dtype=dtype,
        model=None if model is None else Path(model),
        engine_args=tuple(keys.items()),
        **own,
    )


def _check_engine_args(engine: str, args: dict[str, str], flag: str) -> None:
    for key, why in REFUSED.items():
        if key in args:
            raise ProbeError(f"{flag}: key '{key}' does not apply to locate ({why})")
    known = {field.name for field in fields(training_options_class(engine))}
    also = f"; locate's own keys: {', '.join(OWN[engine])}" if set(args) - known else ""
    try:
        options = build_engine_options(engine, args)
    except ProbeError as exc:
        raise ProbeError(f"{flag}: {first_line(exc)}{also}") from exc
    for key in ONE_PROCESS:
        if getattr(options, key, 1) != 1:
            raise ProbeError(f"{flag}: {key}={args[key]}: locate runs megatron in one process, {key}=1 only")


def _keys(text: str, flag: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ProbeError(f"{flag}: '{item}' is not KEY=VALUE")
        if key in found:
            raise ProbeError(f"{flag}: key '{key}' given twice")
        if key in OWN["hf"] and not value.strip():  # an engine's option may be empty (none, or weight_quant_skip=)
            raise ProbeError(f"{flag}: key '{key}' has no value")
        found[key] = value.strip()
    return found
