"""Out of memory as one line (exit 1): which pass, on which device, at which stage (loading, or which batch), what
it needed by estimate against what the device had, and the options that would make it fit.

The estimate is parameters x bytes of the dtype at load (parameters counted from the checkpoint's safetensors
headers, not from the files' bytes, so an FP8 checkpoint counts what it loads as), and in a batch the largest
tensors of its forward: attention scores as an eager kernel materialises them (`sequences x heads x width^2`,
float32), one LM-head chunk's float32 logits and log-softmax (`min(tokens, 256) x vocabulary x 8`), and the hidden
states (`tokens x hidden x 4 x 8`). It is an estimate, and the line says so. Batches are never shrunk behind the user's back: a rescore with another batch shape scores
differently, and that difference is what probe measures. So the line names `--batch-size`, and the user chooses.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import struct
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.jsonfile import read_json

# What an allocator says when it cannot: the CPU allocator's "DefaultCPUAllocator: can't allocate memory", CUDA's
# "CUDA out of memory", and the C library's ENOMEM as numpy or safetensors report it.
ALLOCATOR_PHRASES = ("can't allocate memory", "out of memory", "cannot allocate memory", "not enough memory")
DTYPE_BYTES = {"fp32": 4, "fp32-bf16w": 4, "bf16": 2, "fp16": 2}
GB = 1e9
T = TypeVar("T")


class OutOfMemory(EngineFailure):
    """A pass ran out of memory: exit 1, one line naming what would fit."""


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in ALLOCATOR_PHRASES)


@dataclass(frozen=True, kw_only=True)
class MemoryContext:
    """What the line says about the pass that failed."""

    command: str  # "rescore hf-fp32", "generate"
    engine: str  # hf, megatron, ...
    dtype: str
    device: str  # cpu, cuda:0, auto
    model: Path
    vocab_size: int
    batch_size: int
    hidden_size: int = 0
    heads: int = 0


def checkpoint_parameters(folder: Path) -> int | None:
    """Parameters stored in the checkpoint's safetensors files (their headers only); None without any."""
    total, found = 0, False
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and not name.endswith("_scale_inv"):
                count = 1
                for n in entry.get("shape", []):
                    count *= n
                total, found = total + count, True
    return total if found else None


def available_bytes(device: str) -> int | None:
    """Free memory of `device` now: CUDA's free bytes, or on the CPU the lesser of the system's available memory and
    what this process's address-space limit (ulimit -v, RLIMIT_AS) leaves it; None where neither is known."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        return None
    known = []
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    status = Path("/proc/self/status")
    if limit != resource.RLIM_INFINITY and status.is_file():
        used = next(
            (int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line.startswith("VmSize:")), 0
        )
        known.append(max(limit - used, 0))
    return min(known) if known else None


def _gb(n: float | None) -> str:
    return "unknown" if n is None else f"{n / GB:.1f} GB"


def held_bytes(folder: Path, dtype: str, *, engine: str, quantized: bool = False) -> int:
    """Bytes a pass holds per parameter of the checkpoint at `folder`. The hf engine keeps a checkpoint stored
    wholly in bf16 or fp16 as stored for an fp32 pass, and fp32-bf16w loads bf16, each computing in fp32 a module at
    a time (engines/hf/upcast.py); a quantized pass holds its weights' codes, fewer bytes than its dtype's (counted
    at the dtype's: an upper bound), but an fp32 quantized pass loads fp32. megatron builds its model at the dtype."""
    if engine == "hf" and not quantized and dtype in ("fp32", "fp32-bf16w"):
        from mismatch_probe.engines.hf.upcast import stored_half_dtype  # torch, only where an estimate is asked

        if dtype == "fp32-bf16w" or stored_half_dtype(folder) is not None:
            return 2
    return DTYPE_BYTES.get(dtype, 4)


def loading_line(ctx: MemoryContext) -> str:
    params = checkpoint_parameters(ctx.model)
    need = None if params is None else params * held_bytes(ctx.model, ctx.dtype, engine=ctx.engine)
    what = "" if params is None else f" ({params / 1e9:.2f}B parameters in {ctx.dtype})"
    fits = ["--engine-arg device_map=auto (spread the layers over the GPUs and the CPU)"]
    if ctx.engine == "megatron":
        fits = ["--engine-arg tensor_parallel=N or expert_parallel=N under torchrun (shard over N GPUs)"]
    if ctx.dtype.startswith("fp32"):
        fits.append(
            "--dtype bf16 with the fp32 knob on fewer modules (--engine-arg lm_head_dtype=fp32 or router_dtype=fp32)"
        )
    return (
        f"{ctx.command} on {ctx.device}: out of memory loading {ctx.model}: it needs about {_gb(need)}{what} by "
        f"estimate, the device had {_gb(available_bytes(ctx.device))} free; to fit: {', or '.join(fits)}"
    )


def batch_bytes(ctx: MemoryContext, sequences: int, tokens: int, width: int) -> int:
    scores = sequences * ctx.heads * width * width * 4
    return scores + min(tokens, 256) * ctx.vocab_size * 8 + tokens * ctx.hidden_size * 32


def batch_line(ctx: MemoryContext, where: str, batch: tuple[int, int, int], kept: str, chunk: bool = True) -> str:
    """`batch`: (sequences, tokens, the longest sequence's length); `chunk`: the engine takes `logprob_chunk` (the
    training engines)."""
    sequences, tokens, width = batch
    need = batch_bytes(ctx, sequences, tokens, width)
    fits = f"a smaller --batch-size (now {ctx.batch_size})"
    if chunk:
        fits += " or --engine-arg logprob_chunk=N (fewer positions' logits at a time)"
    return (
        f"{ctx.command} on {ctx.device}: out of memory in {where}, a batch of {sequences} sequences ({tokens} tokens, "
        f"the longest {width}; about {_gb(need)} for its attention scores, logits and hidden states by estimate, "
        "beside the weights), the device had "
        f"{_gb(available_bytes(ctx.device))} free; {kept}; to fit: {fits}, then --resume"
    )


def unplaced_line(exc: BaseException) -> str:
    """Out of memory outside the stages that name themselves (a report, a locate side): the allocator's own line
    and what makes any pass need less."""
    said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return (
        f"out of memory ({said}); a smaller --batch-size, --engine-arg device_map=auto, or the fp32 knob on fewer "
        "modules needs less (--debug shows where)"
    )


def device_of(config) -> str:
    """The device an engine config computes on, as the line names it: its `device` option, `auto` resolved."""
    import torch

    device = str(config.engine_args.get("device", "auto"))
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return device


def context(command: str, engine: str, model, config) -> MemoryContext:
    """The MemoryContext of a pass of `engine` on `model` (a ModelInfo) with `config` (an EngineConfig)."""
    try:  # the sizes the batch estimate uses; a checkpoint without them gets the logits' estimate alone
        raw = read_json(Path(model.path) / "config.json")
    except ProbeError:
        raw = {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return MemoryContext(
        hidden_size=int(text.get("hidden_size") or 0),
        heads=int(text.get("num_attention_heads") or 0),
        command=command,
        engine=engine,
        dtype=config.dtype,
        device=device_of(config),
        model=Path(model.path),
        vocab_size=model.vocab_size,
        batch_size=config.batch_size,
    )


def unless_out_of_memory(call: Callable[..., T], *args) -> T | None:
    """`call(*args)`, or None when it ran out of memory, returned once its frames (and the tensors they held) are gone
    so that the caller can write its line; --debug lets the allocator's error through, traceback and all."""
    try:
        return call(*args)
    except Exception as exc:
        if not is_out_of_memory(exc) or os.environ.get("PROBE_DEBUG"):
            raise
    gc.collect()
    return None


@contextmanager
def loading(ctx: MemoryContext):
    """Loading an engine: out of memory becomes OutOfMemory with `loading_line`, raised once the failed attempt's
    frames (and the tensors they hold) are gone, so that the line can be printed and the free memory it names
    is what the device has again; --debug keeps the allocator's traceback chained to it."""
    failed = False
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        if os.environ.get("PROBE_DEBUG"):
            raise OutOfMemory(loading_line(ctx)) from exc
        failed = True
    if failed:
        gc.collect()
        raise OutOfMemory(loading_line(ctx))
