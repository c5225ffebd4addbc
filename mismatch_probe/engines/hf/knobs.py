"""`--engine-arg attn_implementation=`, `lm_head_dtype=` and `router_dtype=` of the `hf` engines: the settings
trainers and inference servers change to shrink the training-inference mismatch, each switched on the loaded
model in place and back (docs/remedies.md, "hf knobs").

- `attn_implementation`: transformers' attention implementation (`set_attn_implementation`), with the
  `kv_quant` wrapper put back around the new one;
- `lm_head_dtype=fp32`: the model's own final hidden states (in the run's dtype), upcast, times an fp32 copy of
  the head's weight, made once: the logits in fp32 (slime's fp32 LM head, maxtext's logits dot in fp32);
- `router_dtype=fp32`: each MoE router's parameters in fp32 and its input upcast, so its product, softmax or
  sigmoid and top-k run in fp32 (Megatron's `moe_router_dtype=fp32`). The gate weights leave the router in
  the dtype the model's own router gives them, so the experts are weighted and combined as the model does.

Every switch keeps the original parameters and is undone by putting them back, so switching back computes
exactly what the model computed before. The values are checked when the options are built, before the run
folder is touched or the model loaded."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch

from mismatch_probe.engines.hf.routing import find_routers
from mismatch_probe.engines.hf.upcast import compute_dtype, computes_in_float32, float32_weights
from mismatch_probe.engines.options import option
from mismatch_probe.errors import ProbeError, first_line
from mismatch_probe.model.moe import adapter_named
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.quant.kv import WRAPPER_PREFIX, apply_kv_quant
from mismatch_probe.vocab import BF16, FP16, FP32

ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")
FLASH = "flash_attention_2"
KNOB_DTYPES = (FP32,)
KNOB_KEYS = ("attn_implementation", "lm_head_dtype", "router_dtype")
DTYPE_NAMES = {torch.bfloat16: BF16, torch.float16: FP16, torch.float32: FP32}


@dataclass(frozen=True)
class KnobOptions:
    """What the loaded model computes with, beyond its dtype: switchable on a loaded model."""

    attn_implementation: str | None = option(
        None, f"{', '.join(ATTENTION)}: transformers' attention implementation (none: the model's default, sdpa)"
    )
    lm_head_dtype: str | None = option(
        None, "fp32: the final hidden states upcast times an fp32 copy of the LM head weight (none: the run's dtype)"
    )
    router_dtype: str | None = option(
        None, "fp32: each MoE router's product, softmax or sigmoid and top-k in fp32 (none: the model's own)"
    )

    def check_knobs(self) -> None:
        for key, value, allowed in (
            ("attn_implementation", self.attn_implementation, ATTENTION),
            ("lm_head_dtype", self.lm_head_dtype, KNOB_DTYPES),
            ("router_dtype", self.router_dtype, KNOB_DTYPES),
        ):
            if value is not None and value not in allowed:
                raise ProbeError(f"--engine-arg {key}={value}: expected one of none, {', '.join(allowed)}")
        if self.attn_implementation == FLASH and importlib.util.find_spec("flash_attn") is None:
            raise ProbeError(
                f"--engine-arg attn_implementation={FLASH}: needs the flash_attn package, which is not installed "
                "(pip install flash-attn)"
            )


def apply_knobs(hf: torch.nn.Module, model: ModelInfo, options) -> Knobs:
    """Switch the loaded (and quantized) `hf` to `options`' knobs; the handle that switches them again."""
    knobs = Knobs(hf, model, options.kv_quant)
    knobs.apply(options)
    return knobs


class Knobs:
    """The knobs of one loaded model: what it computed when loaded, and what it computes now."""

    def __init__(self, hf: torch.nn.Module, model: ModelInfo, kv_quant: str | None):
        self.hf, self.kv_quant = hf, kv_quant
        self.default_attention = self.attention()
        self.head: _Float32Head | None = None
        routers = find_routers(hf, model)
        weights_at = adapter_named(model.moe_family).style.weights_at if routers else 0
        hidden = int(hf.config.get_text_config().hidden_size)
        dtype = compute_dtype(hf)  # the hidden states' dtype: what the routers are given
        self.routers = [_RouterSwitch(router, weights_at, hidden, dtype) for router in routers]

    def apply(self, options: KnobOptions) -> None:
        self._attention(options.attn_implementation or self.default_attention)
        self._head(options.lm_head_dtype == FP32)
        for router in self.routers:
            router.switch(options.router_dtype == FP32)

    def attention(self) -> str:
        """The attention implementation the model runs (under `kv_quant`, the one its wrapper calls)."""
        name = self.hf.config._attn_implementation or "eager"
        return name.removeprefix(WRAPPER_PREFIX)

    def describe(self) -> dict:
        """The effective values, for the manifest: router_dtype is the dtype of the routers' product (None for a
        dense model), lm_head_dtype that of the head's."""
        fp32 = self.head is not None or computes_in_float32(self.hf)  # the head's fp32 weights exist during calls
        head = torch.float32 if fp32 else self.hf.get_output_embeddings().weight.dtype
        routers = self.routers[0].product_dtype() if self.routers else None
        return {
            "attn_implementation": self.attention(),
            "lm_head_dtype": DTYPE_NAMES.get(head, str(head)),
            "router_dtype": None if routers is None else DTYPE_NAMES.get(routers, str(routers)),
        }

    def _attention(self, name: str) -> None:
        if name == self.attention():
            return
        try:
            self.hf.set_attn_implementation(name)
        except (ValueError, ImportError, KeyError) as exc:
            raise ProbeError(f"--engine-arg attn_implementation={name}: {first_line(exc)}") from exc
        if self.kv_quant is not None:  # the K/V rounding wraps whichever attention runs
            apply_kv_quant(self.hf, self.kv_quant)

    def _head(self, fp32: bool) -> None:
        if fp32 and self.head is None:
            head = self.hf.get_output_embeddings()
            if not isinstance(head, torch.nn.Linear):
                raise ProbeError(
                    f"--engine-arg lm_head_dtype=fp32: the LM head is a {type(head).__name__}, not a linear layer"
                )
            # an fp32 head computes in fp32 already, and so does one upcast while it runs (upcast.py)
            if head.weight.dtype != torch.float32 and not computes_in_float32(self.hf):
                self.head = _Float32Head(head)
        elif not fp32 and self.head is not None:
            self.head.undo()
            self.head = None


def _upcast(value):
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class _Float32Head:
    """The head's own module computing `F.linear(h.float(), W.float(), b.float())`: while it runs, its weight and
    bias replaced by fp32 copies made for the call (the originals put back after it, so the model holds no fp32
    copy between calls; a head tied to the embeddings is tied to nothing during the call, so the embeddings keep
    their dtype, and a quantized head's products are not intercepted: they multiply the fp32 copy of the weights
    written back) and its input upcast. Hooks already on the head (an act_quant rounding) run first, in the run's
    dtype."""

    def __init__(self, head: torch.nn.Linear):
        self.module = head
        self.original = {name: getattr(head, name) for name in ("weight", "bias") if getattr(head, name) is not None}
        self.handles = [
            head.register_forward_pre_hook(self._enter),
            head.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, head, args):
        for name, parameter in self.original.items():
            setattr(head, name, torch.nn.Parameter(parameter.detach().float(), requires_grad=False))
        return (_upcast(args[0]), *args[1:])

    def _exit(self, _head, _args, _output) -> None:
        self._put_back()

    def _put_back(self) -> None:
        for name, parameter in self.original.items():
            setattr(self.module, name, parameter)

    def undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        self._put_back()


class _RouterSwitch:
    """One router, switchable to fp32: its floating parameters and buffers (the originals kept) in fp32 and its
    inputs upcast, so its own forward computes in fp32; a first forward hook casts its gate weights back to the
    dtype the router gives them when not switched (read from one call of its own forward at the start). The
    logits stay fp32: the router tap's margins and R3's recomputed gate weights read them, so replaying the
    router's own choice still gives its own weights bit for bit."""

    def __init__(self, router: torch.nn.Module, weights_at: int, hidden: int, dtype: torch.dtype):
        self.router, self.weights_at = router, weights_at
        device = next(router.parameters()).device
        # forward itself, not the module call: no hook (the tap's, locate's) sees it; a model computing in fp32 over
        # half-precision weights (upcast.py) runs it on its weights upcast, as its own call would
        with torch.no_grad(), float32_weights(router) if dtype == torch.float32 else contextlib.nullcontext():
            output = _as_tuple(router.forward(torch.zeros(1, hidden, dtype=dtype, device=device)))
        self.weights_dtype = output[weights_at].dtype
        self.own_product = next(t.dtype for i, t in enumerate(output) if i != weights_at and t.is_floating_point())
        self.saved: list[tuple[torch.nn.Module, str, torch.Tensor, bool]] = []
        self.handles: list = []

    def product_dtype(self) -> torch.dtype:
        return torch.float32 if self.handles else self.own_product

    def switch(self, fp32: bool) -> None:
        if fp32 and not self.handles:
            for module in self.router.modules():
                for name, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
                    if tensor.is_floating_point() and tensor.dtype != torch.float32:
                        self.saved.append((module, name, tensor.data, isinstance(tensor, torch.nn.Parameter)))
                        _set(module, name, tensor.data.float(), self.saved[-1][3])
            self.handles = [
                self.router.register_forward_pre_hook(_upcast_inputs, with_kwargs=True),
                self.router.register_forward_hook(self._weights_back, prepend=True),
            ]
        elif not fp32 and self.handles:
            for handle in self.handles:
                handle.remove()
            for module, name, tensor, is_parameter in self.saved:
                _set(module, name, tensor, is_parameter)
            self.saved, self.handles = [], []

    def _weights_back(self, _module, _args, output):
        parts = list(_as_tuple(output))
        parts[self.weights_at] = parts[self.weights_at].to(self.weights_dtype)
        return type(output)(parts) if isinstance(output, (tuple, list)) else parts[0]


def _set(module: torch.nn.Module, name: str, tensor: torch.Tensor, is_parameter: bool) -> None:
    if is_parameter:
        getattr(module, name).data = tensor  # the same Parameter object stays registered; only its values change
    else:
        module._buffers[name] = tensor


def _upcast_inputs(_module, args, kwargs):
    return tuple(_upcast(a) for a in args), {key: _upcast(value) for key, value in kwargs.items()}


def _as_tuple(output) -> tuple:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)
