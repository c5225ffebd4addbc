"""A quantized module's products computed as the kernel computes them: operands are codes x scales in float32,
products are accumulated in float32, and only the output (bias added in float32, as the fp8 GEMMs' epilogues
add it) is cast to the run's dtype.

- `emulate`: the activation fake-quantized in float32 and multiplied with the weight's float32 operand;
- `kernel`: `torch._scaled_mm` on e4m3 codes, one call per K chunk (the narrowest of the two operands'
  K blocks: 128 for block scaling, all of K for per-tensor, per-channel and per-token scales) with the chunk's
  row-wise scales, the chunks summed in float32 — DeepSeek-V3's promotion of the partial sums every 128 of K.

Each quantized module runs its forward inside `QuantProducts`, a TorchFunctionMode: a product (`linear`,
`matmul`, `mm`, ...) whose weight argument is one of the module's quantized parameters or a view of it (a
fused expert parameter's `W[e]`) is replaced; any other operation runs as is.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from mismatch_probe.errors import ProbeError
from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.codes import CODE
from mismatch_probe.quant.operands import Operand, StoredOperand
from mismatch_probe.quant.schemes import ACT_BLOCKS, ACT_SCHEMES, fp8_codes_and_scales

Fn = Callable[[torch.Tensor], torch.Tensor]
COMPUTE = ("auto", "emulate", "kernel")
_PRODUCT = re.compile(r"linear|matmul|mm")


def kernel_available(device: torch.device, weight_fp8: bool, act: str | None) -> str | None:
    """None when `torch._scaled_mm` can run this quantization on `device`, else why not (one phrase)."""
    if not weight_fp8 or act not in ACT_BLOCKS:
        return "the kernel path needs an fp8 weight scheme (fp8-block128, fp8-channel, fp8-tensor) and an fp8 act_quant"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has no fp8 GEMM (compute capability 8.9 or newer)"
    try:  # row-wise scales with a float32 output: what each K chunk asks of this build
        one = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(one, one.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch {torch.__version__} cannot run _scaled_mm on {device.type} ({str(exc).splitlines()[0]})"
    return None


def kernel_product(x: torch.Tensor, operand: Operand, act: str, offs: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T` by `torch._scaled_mm` per K chunk: `operand` a weight `[N, K]`, or with `offs` (a grouped
    product over experts) `[E, N, K]`, rows `offs[e-1]:offs[e]` of `x` going to expert `e`. The activation's
    codes and scales are taken once over the whole call (a per-tensor scale spans every token of it, as in a
    fused MoE), then each expert's rows are multiplied."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows, cols = ACT_BLOCKS[act]
    x_codes, x_scales = fp8_codes_and_scales(x.reshape(-1, k), rows, cols)
    chunk = min(b for b in (cols, operand.k_block, k) if b != WHOLE)
    if offs is None:
        return _chunked(x_codes, x_scales, operand.codes, operand.scales, chunk).reshape(*lead, -1)
    out = torch.zeros(x_codes.shape[0], operand.codes.shape[-2], device=x.device)
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            part = slice(start, end)
            w_codes, w_scales = operand.codes[expert], operand.scales[expert]
            out[part] = _chunked(x_codes[part], x_scales[part], w_codes, w_scales, chunk)
        start = end
    return out


def _chunked(x_codes, x_scales, w_codes, w_scales, chunk: int) -> torch.Tensor:
    """The sum over K chunks of `_scaled_mm(x chunk, w chunk)` with each chunk's row-wise scales, in float32."""
    k = x_codes.shape[-1]
    out = None
    for start in range(0, k, chunk):
        part = slice(start, min(start + chunk, k))
        y = torch._scaled_mm(
            x_codes[:, part].contiguous(),
            w_codes[:, part].contiguous().t(),  # column-major, as the fp8 GEMMs take their second operand
            scale_a=_dense(x_scales[:, start : start + 1]),
            scale_b=_dense(w_scales[:, start].reshape(1, -1)),
            out_dtype=torch.float32,
        )
        out = y if out is None else out + y
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into fresh row-major memory (an expanded scale has stride 0, which _scaled_mm refuses)."""
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


class QuantProducts(TorchFunctionMode):
    """Inside a quantized module's forward: each product with one of `operands`' parameters (or a view of one)
    computed by `kernel_product` (`kernel` true and the operand has codes) or `emulated_product`. Each operand's
    float32 tensors are built at its first product of the forward and dropped when the forward returns."""

    def __init__(self, operands: list[StoredOperand], act: str | None, kernel: bool):
        super().__init__()
        self.operands, self.act, self.kernel = operands, act, kernel
        self.built: dict[int, Operand] = {}
        self.experts = any(o.parameter.dim() == 3 for o in operands)

    def enter(self, _module, _args) -> None:
        self.__enter__()

    def exit(self, _module, _args, _out) -> None:
        self.built.clear()
        self.__exit__(None, None, None)

    def _operand(self, w) -> Operand | None:
        if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
            return None
        for i, stored in enumerate(self.operands):
            if stored.owns(w):
                if i not in self.built:
                    self.built[i] = stored.build()
                return self.built[i].view(w)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or str(func)
        if func is torch.Tensor.to and self.experts and _to_codes(args, kwargs):
            # an input cast to its weight's dtype before a grouped product over experts (transformers'
            # grouped_mm): the weight holds e4m3 codes, the product is ours, and the input stays as it is, as it
            # did when the weight was stored in the run's dtype (only experts modules: nothing else there casts
            # to e4m3, where an attention module's kv_quant rounding does)
            return args[0]
        operand = self._operand(args[1]) if _PRODUCT.search(name) and len(args) >= 2 else None
        if operand is None:
            if _PRODUCT.search(name) and any(_is_code(a) for a in args[:2]):
                raise ProbeError(
                    f"a quantized weight (its e4m3 codes) reached {name} outside its own module's products; "
                    "--engine-arg quant_compute cannot compute this model's quantized products"
                )
            return func(*args, **kwargs)
        x = args[0]
        if self.kernel and operand.codes is not None and _aligned(x, operand):
            linear = "linear" in name  # F.linear(x, W[N, K]); the others multiply x @ W[K, N]
            grouped = operand.values.dim() == 3  # _grouped_mm(x, W[E, K, N], offs)
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None) if grouped else None
            y = kernel_product(x, operand if linear else operand.transposed(), self.act, offs)
            bias = args[2] if linear and len(args) > 2 else kwargs.get("bias")
            return (y if bias is None else y + bias.float()).to(x.dtype)
        # the same product (a linear, a matmul, a grouped product over experts) on float32 operands
        x32 = x.float() if self.act is None else ACT_SCHEMES[self.act](x.float())
        rest = [_f32(a) for a in args[2:]]
        return func(x32, operand.values, *rest, **{k: _f32(v) for k, v in kwargs.items()}).to(x.dtype)


def _is_code(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == CODE


def _to_codes(args, kwargs) -> bool:
    """Whether `Tensor.to(args, kwargs)` casts a floating tensor other than codes to the codes' dtype."""
    target = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, (torch.dtype, torch.Tensor))), None))
    target = target.dtype if isinstance(target, torch.Tensor) else target
    x = args[0] if args else None
    return target == CODE and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != CODE


def _aligned(x: torch.Tensor, operand: Operand) -> bool:
    """Whether the fp8 GEMMs take these shapes: K and N multiples of 16 (else the product is emulated)."""
    return x.shape[-1] % 16 == 0 and all(n % 16 == 0 for n in operand.values.shape[-2:])


def _f32(a):
    """A floating tensor argument (a bias) in float32; anything else (offsets, flags) as it is."""
    return a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
