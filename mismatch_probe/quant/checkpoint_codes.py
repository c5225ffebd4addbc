"""An FP8 checkpoint loaded as its codes: each fp8 weight held in e4m3fn (one byte an element) with its stored
block scales beside it, never as a float32 copy of the model.

transformers loads the checkpoint itself (its own key conversions fuse per-expert linears into the `[E, ...]`
expert parameters; device_map is honoured) in a half dtype, which holds every e4m3 code exactly; the scales
(`weight_scale_inv`, or `weight_scale` per tensor or per output row), which transformers does not read, are read
here from the safetensors files and laid out as `quantized_weight` cuts a parameter into matrices (one per expert
and, for a fused gate_up, gate then up). Each quantized parameter then becomes its e4m3 codes, a tensor at a time
(`keep_codes`: the checkpoint's own quantization follows, quant/apply.py builds its operands from them), or its
dequantized values code x scale in the pass's dtype (the `dequantized` pass, or another weight scheme). A layout
this cannot map (a parameter whose per-expert tensors it cannot name, codes that do not match) raises Unmapped,
and the caller loads the dequantized state dict as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.checkpoint import FP8, PREFIX, Fp8Checkpoint, stored_quantized
from mismatch_probe.quant.codes import Codec, decode
from mismatch_probe.quant.targets import DEFAULT_SKIP, Target, find_targets, quantized_weight

# a fused expert parameter's per-expert checkpoint linears, in the order its matrices are cut (gate, then up)
EXPERT_LINEARS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


class Unmapped(Exception):
    """The checkpoint's layout is not one this loader maps onto the model's parameters."""


@dataclass(frozen=True)
class CodedWeight:
    """A quantized parameter's codec and its scales, one `[*B, nr, 1, nc, 1]` tensor per matrix batch in the
    order `quantized_weight` cuts the parameter; `codes` when the parameter itself holds its dequantized values
    (routers, the LM head: read outside their quantized forwards)."""

    codec: Codec
    scales: tuple[torch.Tensor, ...]
    codes: torch.Tensor | None = None


@dataclass(frozen=True)
class CheckpointCodes:
    """What a model loaded as codes carries for its quantization: the checkpoint's label, each parameter's."""

    label: str
    weights: dict[str, CodedWeight]
    dtype: torch.dtype  # the pass's weight dtype: a plain pass's weights are code x scale rounded to it


def _label(weight: str) -> str:
    return f"{PREFIX}{Path(weight[len(PREFIX) :]).resolve()}"


def _codec(rows: int, cols: int) -> Codec:
    return Codec(rows=rows, cols=cols, split=None, join=lambda codes, scale: codes * scale)


class _Stored:
    """The checkpoint's tensors read one at a time from its safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.files = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            handle = safe_open(str(file), framework="pt")
            for key in handle.keys():
                self.files[key] = handle

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise Unmapped(name)
        return self.files[name].get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.files


def _scale(stored: _Stored, name: str, rows: int, cols: int, block) -> tuple[Codec, torch.Tensor]:
    """(codec, `[nr, 1, nc, 1]` float32 scales) of the fp8 weight `name` of `rows` x `cols`."""
    if block is not None:
        br, bc = block
        scale = stored.get(f"{name}_scale_inv").float()
        nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
        if tuple(scale.shape) != (nr, nc):
            raise Unmapped(name)
        return _codec(br, bc), scale.reshape(nr, 1, nc, 1)
    scale = stored.get(f"{name}_scale").float()
    if scale.numel() == rows and rows != 1:
        return _codec(1, WHOLE), scale.reshape(rows, 1, 1, 1)
    if scale.numel() != 1:
        raise Unmapped(name)
    return _codec(WHOLE, WHOLE), scale.reshape(1, 1, 1, 1)


def _sources(target: Target, stored: _Stored, quantized: set[str]) -> list[list[str]]:
    """The checkpoint names of the target's matrices: one list per matrix batch `quantized_weight` cuts."""
    if not target.experts:
        if target.name not in quantized:
            raise Unmapped(target.name)
        return [[target.name]]
    prefix, _, attr = target.name.rpartition(".")
    experts = target.parameter.shape[0]
    for leaves in EXPERT_LINEARS.get(attr, ()):
        names = [[f"{prefix}.{e}.{leaf}.weight" for e in range(experts)] for leaf in leaves]
        if all(n in quantized for batch in names for n in batch):
            return names
    raise Unmapped(target.name)


def _same_codes(stored: torch.Tensor, loaded: torch.Tensor) -> bool:
    if stored.dtype != FP8 or stored.shape != loaded.shape:
        return False
    return torch.equal(stored.view(torch.uint8), loaded.to("cpu").contiguous().view(torch.uint8))


def _matrices(target: Target, w: torch.Tensor) -> list[torch.Tensor]:
    """The matrix batches of `w` (the target's layout) in the order `quantized_weight` cuts them."""
    cut: list[torch.Tensor] = []
    quantized_weight(target, lambda m: cut.append(m) or m, source=w)
    return cut


def stored_layout(checkpoint: Fp8Checkpoint) -> tuple[set[str], set[str]]:
    """(the names of the checkpoint's fp8 tensors, the safetensors dtypes of its other floating tensors), read
    from the files' headers."""
    stored = _Stored(checkpoint.path)
    fp8, others = set(), set()
    for name, handle in stored.files.items():
        kind = handle.get_slice(name).get_dtype()
        if kind == "F8_E4M3":
            fp8.add(name)
        elif kind.startswith(("F", "BF")) and not name.endswith(("_scale", "_scale_inv")):
            others.add(kind)
    return fp8, others


def cast_floating(model: torch.nn.Module, dtype: torch.dtype, keep: set[int]) -> None:
    """Every floating parameter and buffer of `model` but those in `keep` (ids) in `dtype`, as `Module.to` casts."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None and id(tensor) not in keep and tensor.is_floating_point():
                    tensor.data = tensor.data.to(dtype)


def _decoded(target: Target, codes: torch.Tensor, scales: list[torch.Tensor], codec: Codec, dtype) -> torch.Tensor:
    """code x scale of each matrix of `codes` (the target's layout) in `dtype`, a matrix batch at a time."""
    pieces = iter(scales)
    return quantized_weight(target, lambda c: decode(c, next(pieces), codec).to(dtype), source=codes)


@torch.no_grad()
def to_codes(
    model: torch.nn.Module, checkpoint: Fp8Checkpoint, quantized: set[str], dtype, keep_codes: bool, values_dtype=None
):
    """Turn each fp8-stored parameter of `model` (holding its codes in a half dtype) into its e4m3 codes
    (`keep_codes`) or its dequantized values in `dtype`, a parameter at a time; the other floating parameters
    are cast to `dtype`. Sets `model.fp8_codes` (CheckpointCodes) when keeping codes. Raises Unmapped."""

    stored = _Stored(checkpoint.path)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    weights: dict[str, CodedWeight] = {}
    targets = [t for t in find_targets(model) if stored_quantized(t.name, quantized)]
    used: set[str] = set()
    for target in targets:
        if id(target.parameter) in tied:
            raise Unmapped(target.name)
        codes = target.parameter.detach().to(FP8)
        codec, scales = None, []
        for batch, matrices in zip(_sources(target, stored, quantized), _matrices(target, codes), strict=True):
            used.update(batch)
            parts = [_scale(stored, name, *matrices.shape[-2:], checkpoint.block) for name in batch]
            blocks = {(c.rows, c.cols) for c, _ in parts} | ({(codec.rows, codec.cols)} if codec else set())
            if len(blocks) != 1:  # one codec for every matrix of a parameter
                raise Unmapped(target.name)
            codec = parts[0][0]
            ckpt = torch.stack([stored.get(n) for n in batch]) if target.experts else stored.get(batch[0])
            if not _same_codes(ckpt, matrices):
                raise Unmapped(target.name)  # transformers' fused layout is not the one mapped here
            scale = torch.stack([s for _, s in parts]) if target.experts else parts[0][1]
            scales.append(scale.to(codes.device))
        values = None
        if not keep_codes or any(name in target.name for name in DEFAULT_SKIP):
            values = _decoded(target, codes, scales, codec, values_dtype or dtype)
        if keep_codes:
            kept = codes if values is not None else None
            weights[target.name] = CodedWeight(codec=codec, scales=tuple(scales), codes=kept)
        target.parameter.data = codes if values is None else values
    if used != quantized:  # an fp8 tensor loaded (as raw codes) into a parameter of another name
        raise Unmapped(sorted(quantized - used)[0])
    cast_floating(model, dtype, keep={id(t.parameter) for t in targets})
    if keep_codes:
        model.fp8_codes = CheckpointCodes(label=checkpoint.label, weights=weights, dtype=dtype)
    return model


@torch.no_grad()
def dequantize_codes(model: torch.nn.Module, weight: str | None) -> None:
    """A model loaded as its checkpoint's codes whose pass is not that checkpoint's quantization (the
    `dequantized` pass, another weight scheme): each parameter holding codes gets code x scale, rounded to the
    pass's weight dtype and held in the dtype of the model's other weights, a parameter at a time."""
    coded: CheckpointCodes | None = getattr(model, "fp8_codes", None)
    if coded is None or (weight or "").startswith(PREFIX) and _label(weight) == coded.label:
        return
    held = model.get_input_embeddings().weight.dtype
    for target in find_targets(model):
        weight = coded.weights.get(target.name)
        if weight is not None and weight.codes is None:
            values = _decoded(target, target.parameter.detach(), list(weight.scales), weight.codec, coded.dtype)
            target.parameter.data = values.to(held)
    del model.fp8_codes


def load_codes(checkpoint: Fp8Checkpoint, config) -> torch.nn.Module | None:
    """The checkpoint's model with its fp8 weights as codes (`fp8_codes` set), on the CPU; None where its layout
    is not mapped."""
    from mismatch_probe.errors import ProbeError

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fp8, _ = stored_layout(checkpoint)
    try:
        model = load_half(checkpoint, config, torch.bfloat16)
        return to_codes(model, checkpoint, fp8, torch.bfloat16, keep_codes=True)
    except Unmapped:
        return None
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"{checkpoint.path}: cannot load the FP8 checkpoint ({str(exc).splitlines()[0]})") from exc


def load_half(checkpoint: Fp8Checkpoint, config, dtype: torch.dtype, **kwargs) -> torch.nn.Module:
    """transformers' load of the checkpoint folder in `dtype` (its fp8 weights as their code values), without
    its report of the scale tensors it does not read; a parameter the folder lacks raises Unmapped (the float32
    load then says so as it always has)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists every `_scale_inv` as unexpected
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            checkpoint.path, config=config, dtype=dtype, output_loading_info=True, **kwargs
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if info.get("missing_keys"):
        raise Unmapped(sorted(info["missing_keys"])[0])
    return model
