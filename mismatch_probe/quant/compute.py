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

from mismatch_probe.quant.blocks import WHOLE
from mismatch_probe.quant.operands import Operand
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


def kernel_product(x: torch.Tensor, operand: Operand, act: str) -> torch.Tensor:
    """`x @ W.T` by `torch._scaled_mm` per K chunk (`operand` a weight `[N, K]` with codes and scales)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows, cols = ACT_BLOCKS[act]
    x_codes, x_scales = fp8_codes_and_scales(x.reshape(-1, k), rows, cols)
    w_codes, w_scales = operand.codes, operand.scales
    chunk = min(b for b in (cols, operand.k_block, k) if b != WHOLE)
    out = None
    for start in range(0, k, chunk):
        part = slice(start, min(start + chunk, k))
        a = x_codes[:, part].contiguous()
        b = w_codes[:, part].contiguous().t()  # column-major, as the fp8 GEMMs take their second operand
        y = torch._scaled_mm(
            a,
            b,
            scale_a=x_scales[:, start : start + 1].contiguous(),
            scale_b=w_scales[:, start].reshape(1, -1).contiguous(),
            out_dtype=torch.float32,
        )
        out = y if out is None else out + y
    return out.reshape(*lead, -1)


class QuantProducts(TorchFunctionMode):
    """Inside a quantized module's forward: each product with one of `operands`' parameters (or a view of one)
    computed by `kernel_product` (`kernel` true and the operand has codes) or `emulated_product`."""

    def __init__(self, operands: list[Operand], act: str | None, kernel: bool):
        super().__init__()
        self.operands, self.act, self.kernel = operands, act, kernel

    def enter(self, _module, _args) -> None:
        self.__enter__()

    def exit(self, _module, _args, _out) -> None:
        self.__exit__(None, None, None)

    def _operand(self, w) -> Operand | None:
        if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
            return None
        return next((v for o in self.operands if (v := o.view(w)) is not None), None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or str(func)
        operand = self._operand(args[1]) if _PRODUCT.search(name) and len(args) >= 2 else None
        if operand is None:
            return func(*args, **kwargs)
        x = args[0]
        if self.kernel and operand.codes is not None and operand.values.dim() == 2:
            linear = "linear" in name  # F.linear(x, W[N, K]); the others multiply x @ W[K, N]
            y = kernel_product(x, operand if linear else operand.transposed(), self.act)
            bias = args[2] if linear and len(args) > 2 else kwargs.get("bias")
            return (y if bias is None else y + bias.float()).to(x.dtype)
        # the same product (a linear, a matmul, a grouped product over experts) on float32 operands
        x32 = x.float() if self.act is None else ACT_SCHEMES[self.act](x.float())
        rest = [_f32(a) for a in args[2:]]
        return func(x32, operand.values, *rest, **{k: _f32(v) for k, v in kwargs.items()}).to(x.dtype)


def _f32(a):
    """A floating tensor argument (a bias) in float32; anything else (offsets, flags) as it is."""
    return a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
