"""fp32 compute over half-precision parameters: a bf16 (or fp16) checkpoint scored in fp32 keeps its parameters
as stored, and each module holds fp32 copies of its own parameters and buffers only while it runs.

Upcasting bf16 or fp16 to fp32 is exact, so a module whose weights are upcast as it is called computes exactly
what the same module loaded in fp32 computes: the log-probs are those of an fp32 load bit for bit, at the
memory of one half-precision copy of the model plus the fp32 weights of the module running (one linear, or one
layer's fused experts). A pre-hook swaps each half-precision parameter's data (the same Parameter object stays
registered, so hooks, views and quantization operands keyed on it still find it) and upcasts the module's
floating inputs (an fp32 model is given fp32 hidden states; a caller passing half precision gets what an fp32
model would compute on the upcast input); a forward hook, called even when the forward raises, puts the stored
tensors back.
"""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager
from pathlib import Path

import torch

HALF = (torch.bfloat16, torch.float16)
SAFETENSORS_HALF = {"BF16": torch.bfloat16, "F16": torch.float16}
MARK = "_probe_upcast"  # set on a model whose half-precision weights compute in fp32


def stored_half_dtype(path: str | Path) -> torch.dtype | None:
    """The one half-precision dtype every floating tensor of the checkpoint's safetensors files is stored in;
    None when they mix dtypes, hold any fp32 or fp8 tensor, or the headers cannot be read (the caller then loads
    in fp32, as before). Reads only each file's header."""
    files = sorted(Path(path).glob("*.safetensors"))
    seen: set[str] = set()
    for file in files:
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error):
            return None
        seen |= {entry["dtype"] for key, entry in header.items() if key != "__metadata__" and isinstance(entry, dict)}
    floating = {d for d in seen if d.startswith(("F", "BF"))}
    if len(floating) != 1 or next(iter(floating)) not in SAFETENSORS_HALF:
        return None
    return SAFETENSORS_HALF[next(iter(floating))]


def compute_in_float32(hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` (half-precision parameters) computing in fp32: each module with half-precision parameters or
    buffers of its own upcasts them while it runs."""
    for module in hf.modules():
        if _half_tensors(module):
            upcast = _Upcast(module)
            module.register_forward_pre_hook(upcast.enter, with_kwargs=True)
            module.register_forward_hook(upcast.exit, always_call=True)
    setattr(hf, MARK, True)
    return hf


def computes_in_float32(hf: torch.nn.Module) -> bool:
    return bool(getattr(hf, MARK, False))


def compute_dtype(hf: torch.nn.Module) -> torch.dtype:
    """The dtype the model's hidden states are computed in: fp32 for a model set up by `compute_in_float32`,
    else its input embeddings' dtype."""
    return torch.float32 if computes_in_float32(hf) else hf.get_input_embeddings().weight.dtype


@contextmanager
def float32_weights(module: torch.nn.Module):
    """Every half-precision parameter and buffer under `module` upcast for the block (its forward called directly,
    without hooks), put back after."""
    saved = [swap for sub in module.modules() for swap in _upcast_tensors(sub)]
    try:
        yield module
    finally:
        _restore(saved)


def _half_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is a parameter) of the module's own half-precision parameters and buffers."""
    own = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
    own += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
    return [(n, t, p) for n, t, p in own if t is not None and t.dtype in HALF]


def _upcast_tensors(module: torch.nn.Module) -> list:
    saved = []
    for name, tensor, is_parameter in _half_tensors(module):
        saved.append((module, name, tensor.data if is_parameter else tensor, is_parameter))
        if is_parameter:
            tensor.data = tensor.data.float()  # the Parameter object stays; only its data is swapped
        else:
            module._buffers[name] = tensor.float()
    return saved


def _restore(saved: list) -> None:
    for module, name, stored, is_parameter in reversed(saved):
        if is_parameter:
            getattr(module, name).data = stored
        else:
            module._buffers[name] = stored


def _upcast(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in HALF else value


class _Upcast:
    """One module's swap: the stored tensors while it runs (a stack: a module called again from inside its own
    forward restores in order)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.stack: list[list] = []

    def enter(self, module, args, kwargs):
        self.stack.append(_upcast_tensors(module))
        return tuple(_upcast(a) for a in args), {key: _upcast(value) for key, value in kwargs.items()}

    def exit(self, _module, _args, _output):
        if self.stack:
            _restore(self.stack.pop())
