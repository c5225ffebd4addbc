"""An engine configuration as `probe locate` takes it: ENGINE:DTYPE[:KEY=VALUE[,KEY=VALUE...]].

hf and megatron run with hooks (megatron: the megatron training engine's megatron-core model, TP = EP = 1, in
this process). The keys are the ones this command can honour: `model` (another checkpoint), and for hf only
`attn_implementation` (passed to transformers) and `device` (cpu, cuda, cuda:1...; megatron takes the current
CUDA device when torch sees one, else the CPU, as its engine does). Any other key is an error naming it: a knob silently ignored would locate a
difference that is not there."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.vocab import DTYPE_ALIASES, DTYPES

ENGINES = ("hf", "megatron")  # the engines probe locate hooks; sglang and vllm give no hooks
HOOKED = ENGINES
HF_ONLY = ("attn_implementation", "device")
KEYS = ("model", "attn_implementation", "device")
FORM = "ENGINE:DTYPE[:KEY=VALUE,...], e.g. hf:fp32 or hf:bf16:model=ckpt/,attn_implementation=eager"


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    dtype: str
    model: Path | None = None  # None: the run's model
    attn_implementation: str | None = None
    device: str | None = None

    def text(self) -> str:
        keys = [f"{key}={getattr(self, key)}" for key in KEYS if getattr(self, key) is not None]
        return f"{self.engine}:{self.dtype}" + (":" + ",".join(keys) if keys else "")

    def with_model(self, model: Path) -> EngineSpec:
        """The spec with the run's model filled in where it names none."""
        return self if self.model is not None else replace(self, model=Path(model))


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
    for key in HF_ONLY:
        if engine != "hf" and key in keys:
            raise ProbeError(f"{flag}: key '{key}' applies to hf only; {engine} takes model=PATH")
    model = keys.pop("model", None)
    return EngineSpec(engine=engine, dtype=dtype, model=None if model is None else Path(model), **keys)


def _keys(text: str, flag: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ProbeError(f"{flag}: '{item}' is not KEY=VALUE (known keys: {', '.join(KEYS)})")
        if key not in KEYS:
            raise ProbeError(f"{flag}: unknown key '{key}' (known: {', '.join(KEYS)})")
        if key in found:
            raise ProbeError(f"{flag}: key '{key}' given twice")
        if not value.strip():
            raise ProbeError(f"{flag}: key '{key}' has no value")
        found[key] = value.strip()
    return found
