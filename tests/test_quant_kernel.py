"""Quantized products computed as the kernels compute them (issue 47, part 1): probe's log-probs against an
independent emulation of each kernel written here (explicit per-block dequantization, per-chunk products
accumulated in float32, the output cast to bf16), on a 2-layer Qwen3-MoE whose matrices are all multiples of
128 wide (hidden 256, experts 128 wide; float32 checkpoint, bf16 run).

The emulation's own floor is the same emulation summing its K chunks in the reverse order: probe must sit
within 2x of it, and far below the gap of the fake quant that rounds the dequantized operands to bf16."""

from __future__ import annotations

import types

import pytest
import torch

from mismatch_probe.quant import schemes
from mismatch_probe.quant.apply import quantize_model
from mismatch_probe.quant.targets import DEFAULT_SKIP

# model-level known-answer runs (about 40 s): the full suite's lane, not the dependency lanes' fast one
pytestmark = pytest.mark.slow

E4M3 = torch.float8_e4m3fn
HIDDEN, INNER, EXPERTS = 256, 128, 4

# ---- the independent emulation ----------------------------------------------------------------------------


def dequant_fp8_blocks(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Codes x scale per (br x bc) block in float32, block by block (scale = block absmax / 448); blocks of one
    row (per token) a column of blocks at a time."""
    out = torch.empty_like(w, dtype=torch.float32)
    if br == 1:
        for j in range(0, w.shape[1], bc):
            block = w[:, j : j + bc].float()
            amax = block.abs().amax(dim=1, keepdim=True)
            scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            out[:, j : j + bc] = (block / scale).to(E4M3).float() * scale
        return out
    for i in range(0, w.shape[0], br):
        for j in range(0, w.shape[1], bc):
            block = w[i : i + br, j : j + bc].float()
            amax = block.abs().max()
            scale = amax / 448 if amax > 0 else torch.tensor(1.0)
            out[i : i + br, j : j + bc] = (block / scale).to(E4M3).float() * scale
    return out


def dequant_int4_marlin(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Marlin's w4a16: code x group scale multiplied in the activation dtype (both stored in it)."""
    out = torch.empty_like(w, dtype=torch.float32)
    for j in range(0, w.shape[1], 128):
        group = w[:, j : j + 128].float()
        amax = group.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
        codes = torch.round(group / scale).clamp(-8, 7)
        out[:, j : j + 128] = (codes.to(dtype) * scale.to(dtype)).float()
    return out


def dequant_int4(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int4-g128 with float32 operands: code x group scale in float32 (the emulate path's rule)."""
    out = torch.empty_like(w, dtype=torch.float32)
    for j in range(0, w.shape[1], 128):
        group = w[:, j : j + 128].float()
        amax = group.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
        out[:, j : j + 128] = torch.round(group / scale).clamp(-8, 7) * scale
    return out


WEIGHTS = {
    "fp8-block128": lambda w, dtype: dequant_fp8_blocks(w, 128, 128),
    "fp8-tensor": lambda w, dtype: dequant_fp8_blocks(w, *w.shape),
    "int4-g128": dequant_int4,
    "int4-g128-marlin": dequant_int4_marlin,  # quant_compute=kernel: Marlin's arithmetic
}
ACTS = {"fp8-token128": (1, 128), "fp8-tensor": (None, None), "fp8-token": (1, None)}


def product(x: torch.Tensor, w: torch.Tensor, act: str | None, reverse: bool) -> torch.Tensor:
    """x [T, K] @ w[N, K].T: the activation quantized per block in float32, then the sum over 128-wide K
    chunks of float32 partial products, in order; `reverse`, the floor: 32-wide chunks summed from the last."""
    x = x.float()
    if act is not None:
        br, bc = ACTS[act]
        x = dequant_fp8_blocks(x, br or x.shape[0], bc or x.shape[1])
    width = 32 if reverse else 128
    chunks = list(range(0, x.shape[1], width))
    total = torch.zeros(x.shape[0], w.shape[0])
    for start in reversed(chunks) if reverse else chunks:
        total = total + x[:, start : start + width] @ w[:, start : start + width].t()
    return total


class RefLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, scheme: str, act: str | None, reverse: bool):
        super().__init__()
        self.w, self.act, self.reverse = WEIGHTS[scheme](weight, weight.dtype), act, reverse

    def forward(self, x):
        return (
            product(x.reshape(-1, x.shape[-1]), self.w, self.act, self.reverse).reshape(*x.shape[:-1], -1).to(x.dtype)
        )


def ref_experts(module, scheme: str, act: str | None, reverse: bool):
    """Qwen3-MoE experts, one expert at a time; a per-tensor activation scale spans the whole call (all routed
    tokens), as in a fused MoE kernel."""
    gate_up = [WEIGHTS[scheme](module.gate_up_proj[e, :INNER], module.gate_up_proj.dtype) for e in range(EXPERTS)]
    gate_up = [
        torch.cat([g, WEIGHTS[scheme](module.gate_up_proj[e, INNER:], module.gate_up_proj.dtype)])
        for e, g in enumerate(gate_up)
    ]
    down = [WEIGHTS[scheme](module.down_proj[e], module.down_proj.dtype) for e in range(EXPERTS)]

    def quantized_input(x):  # one scale for all rows of the call when per-tensor
        if act is None:
            return x.float(), None
        br, bc = ACTS[act]
        return dequant_fp8_blocks(x.float(), br or x.shape[0], bc or x.shape[1]), None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        pairs = [(e, *torch.where(top_k_index == e)) for e in range(EXPERTS)]
        x_all, _ = quantized_input(hidden_states[torch.cat([tok for _, tok, _ in pairs])])
        rows, mids, offset = [], [], 0
        for e, tok, pos in pairs:
            x = x_all[offset : offset + len(tok)]
            offset += len(tok)
            h = product(x, gate_up[e], None, reverse).to(hidden_states.dtype)
            mids.append(torch.nn.functional.silu(h[:, :INNER]) * h[:, INNER:])
            rows.append((e, tok, pos))
        m_all, _ = quantized_input(torch.cat(mids))
        out, offset = torch.zeros_like(hidden_states), 0
        for e, tok, pos in rows:
            m = m_all[offset : offset + len(tok)]
            offset += len(tok)
            y = product(m, down[e], None, reverse).to(hidden_states.dtype) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    return types.MethodType(forward, module)


def reference(path, scheme: str, act: str | None, reverse: bool) -> torch.Tensor:
    model = load(path)
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, RefLinear(getattr(attn, name).weight.detach(), scheme, act, reverse))
        layer.mlp.experts.forward = ref_experts(layer.mlp.experts, scheme, act, reverse)
    return logprobs(model)


# ---- the model and the runs ------------------------------------------------------------------------------

IDS = torch.randint(2, 500, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, intermediate_size=256, moe_intermediate_size=INNER, num_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("wide-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def load(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@torch.no_grad()
def logprobs(model) -> torch.Tensor:
    logits = model(IDS).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, IDS[:, 1:, None])[..., 0]


def probe_logprobs(path, scheme, act, compute="emulate") -> torch.Tensor:
    model = load(path)
    quantize_model(model, scheme, act, DEFAULT_SKIP, compute=compute)
    return logprobs(model)


def bf16_dequant_logprobs(path, scheme, act) -> torch.Tensor:
    """The fake quant this replaces: dequantized weights and activations rounded to bf16, products in bf16."""
    model = load(path)
    for layer in model.model.layers:
        modules = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        for m in modules:
            m.weight.data.copy_(schemes.WEIGHT_SCHEMES[scheme](m.weight.data))
            if act:
                m.register_forward_pre_hook(lambda _m, a: (schemes.ACT_SCHEMES[act](a[0]),))
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name).data
            halves = (slice(0, INNER), slice(INNER, 2 * INNER)) if name == "gate_up_proj" else (slice(None),)
            for h in halves:
                p[:, h] = schemes.WEIGHT_SCHEMES[scheme](p[:, h])
    return logprobs(model)


@pytest.mark.parametrize(
    "scheme, act",
    [
        ("fp8-block128", None),
        ("fp8-tensor", None),
        ("int4-g128", None),
        ("fp8-block128", "fp8-token128"),
        ("fp8-tensor", "fp8-tensor"),
        ("fp8-tensor", "fp8-token"),
    ],
)
def test_probe_sits_at_the_kernel_emulations_floor(wide_moe, scheme, act):
    ref = reference(wide_moe, scheme, act, reverse=False)
    floor = (ref - reference(wide_moe, scheme, act, reverse=True)).abs().mean().item()
    gap = (probe_logprobs(wide_moe, scheme, act) - ref).abs().mean().item()
    assert floor > 0 and gap <= 2 * floor
    # the fake quant this replaced (operands rounded to bf16) was well beyond the floor
    today = (bf16_dequant_logprobs(wide_moe, scheme, act) - ref).abs().mean().item()
    assert today > 3 * floor
    if act is not None:  # the kernel path: torch._scaled_mm, which this torch build runs on the CPU too
        kernel = (probe_logprobs(wide_moe, scheme, act, compute="kernel") - ref).abs().mean().item()
        assert kernel <= 2 * floor


def test_int4_kernel_path_is_marlins_arithmetic(wide_moe):
    """quant_compute=kernel for int4-g128: code x group scale rounded to the run's dtype, as Marlin computes it;
    the emulate path (float32 operands) is measurably elsewhere."""
    marlin = reference(wide_moe, "int4-g128-marlin", None, reverse=False)
    floor = (marlin - reference(wide_moe, "int4-g128-marlin", None, reverse=True)).abs().mean().item()
    kernel = probe_logprobs(wide_moe, "int4-g128", None, compute="kernel")
    assert (kernel - marlin).abs().mean().item() <= 2 * floor
    emulate = probe_logprobs(wide_moe, "int4-g128", None)
    assert (emulate - marlin).abs().mean().item() > 3 * floor
