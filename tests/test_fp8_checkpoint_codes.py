"""FP8 checkpoints load as their codes (quant/checkpoint_codes.py): each fp8 weight is held as e4m3fn bytes with
its stored scales beside it, never as a float32 model. Every pass gives the log-probs, router margins, experts
and generated tokens of the previous load (the dequantized float32 state dict, forced here by making the codes
loader refuse the layout) bit for bit: the checkpoint's own quantization (emulate and kernel), the `dequantized`
plain pass, fp32 and fp32-bf16w, another weight scheme over the checkpoint, per-channel scales. The checkpoints
are made here with partial 128-blocks (hidden 200, expert width 72) and random scale factors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import mismatch_probe.engines.hf.model as model_module
import mismatch_probe.quant.apply as apply_module
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.hf.inference import HFInferenceEngine
from mismatch_probe.engines.hf.training import HFTrainingEngine
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.quant.checkpoint_codes import Unmapped
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest

FP8 = torch.float8_e4m3fn
UNQUANTIZED = ("embed_tokens", "norm", "mlp.gate.", "lm_head", "layers.1.mlp.down_proj")


def _fp8(w: torch.Tensor, generator: torch.Generator, per_channel: bool) -> dict[str, torch.Tensor]:
    """{"": codes, suffix: scales} of `w`: 128x128 `_scale_inv` blocks, or one `_scale` per output row; each
    scale is absmax / 448 times a random factor in [1, 3)."""
    rows, cols = w.shape
    if per_channel:
        scale = w.abs().amax(dim=1) / 448 * (1 + 2 * torch.rand(rows, generator=generator))
        return {"": (w / scale[:, None]).to(FP8), "_scale": scale}
    nr, nc = -(-rows // 128), -(-cols // 128)
    padded = torch.nn.functional.pad(w, (0, nc * 128 - cols, 0, nr * 128 - rows))
    absmax = padded.reshape(nr, 128, nc, 128).abs().amax(dim=(1, 3))
    scale = absmax / 448 * (1 + 2 * torch.rand(nr, nc, generator=generator))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return {"": (w / full).to(FP8), "_scale_inv": scale}


def _checkpoint(root, per_channel: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=200, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, intermediate_size=136, moe_intermediate_size=72, num_experts=3, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    plain = root / "plain"
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(plain)
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(2)
    stored = {}
    for name, tensor in load_file(plain / "model.safetensors").items():
        if tensor.dim() != 2 or any(part in name for part in UNQUANTIZED):
            stored[name] = tensor
            continue
        for suffix, part in _fp8(tensor.float(), generator, per_channel).items():
            stored[f"{name}{suffix}"] = part
    folder = root / ("fp8-channel" if per_channel else "fp8")
    folder.mkdir()
    save_file(stored, folder / "model.safetensors")
    raw = json.loads((plain / "config.json").read_text())
    block = {} if per_channel else {"weight_block_size": [128, 128]}
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", **block}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("codes"), per_channel=False)


@pytest.fixture(scope="module")
def fp8_channel(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("codes-channel"), per_channel=True)


BATCH = [
    ScoreRequest(sample_id=i, prompt_id=i, token_ids=np.random.default_rng(i).integers(2, 96, 8 + i), prompt_len=3)
    for i in range(3)
]


def _score(path, dtype: str, engine_args: dict):
    engine_args = {key: value.replace("{model}", str(path)) for key, value in engine_args.items()}
    engine = HFTrainingEngine(load_model_info(path), EngineConfig(dtype=dtype, engine_args=engine_args))
    return engine, engine.score(BATCH, ScoreOptions(temperature=0.7))


def _old_load(monkeypatch):
    """The previous load: the codes loader refuses, so the dequantized float32 state dict is loaded (by the
    model's load and by `weight_quant=checkpoint:`)."""

    def refuse(*_args, **_kwargs):
        raise Unmapped("forced")

    monkeypatch.setattr(model_module, "to_codes", refuse)
    monkeypatch.setattr(apply_module, "load_codes", lambda *_args: None)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_same(ours, theirs):
    for got, want in zip(ours, theirs, strict=True):
        assert _same_bits(got.logprob, want.logprob)
        assert _same_bits(got.router_margin, want.router_margin)
        assert np.array_equal(got.experts, want.experts)


PASSES = [  # (dtype, engine args, whether the fp8 weights stay codes)
    ("bf16", {}, True),
    ("bf16", {"weight_quant": "checkpoint:{model}", "quant_compute": "kernel"}, True),
    ("bf16", {"weight_quant": "dequantized"}, False),
    ("fp32", {}, True),
    ("fp32-bf16w", {"weight_quant": "dequantized"}, False),
    ("bf16", {"weight_quant": "fp8-block128"}, True),  # requantized from code x scale: held as its own codes
]


@pytest.mark.parametrize("dtype,engine_args,coded", PASSES, ids=lambda v: str(v))
def test_each_pass_equals_the_float32_load_bit_for_bit(fp8_block, dtype, engine_args, coded, monkeypatch):
    engine, ours = _score(fp8_block, dtype, engine_args)
    experts = engine.hf.get_submodule("model.layers.0.mlp.experts")
    assert (experts.gate_up_proj.dtype == FP8) == coded  # one byte an element, where the old load held fp32
    kept = engine.hf.model.layers[1].mlp.down_proj.weight  # stored unquantized: quantized only by a scheme
    assert (kept.dtype == FP8) == (engine_args.get("weight_quant") == "fp8-block128")
    _old_load(monkeypatch)
    reference, theirs = _score(fp8_block, dtype, engine_args)
    old = reference.hf.get_submodule("model.layers.0.mlp.experts").gate_up_proj  # fp8 only as a scheme's codes
    assert (old.dtype == FP8) == (engine_args.get("weight_quant") == "fp8-block128")
    assert engine.describe() == reference.describe()
    _assert_same(ours, theirs)


def test_per_channel_scales_and_the_checkpoint_option(fp8_channel, fp8_block, monkeypatch):
    """Per-channel `weight_scale`; `weight_quant=checkpoint:` of the folder itself, with another act scheme."""
    ours = [
        _score(fp8_channel, "bf16", {})[1],
        _score(fp8_block, "fp32", {"weight_quant": "checkpoint:{model}", "act_quant": "fp8-tensor"})[1],
    ]
    engine, _ = _score(fp8_channel, "bf16", {})
    assert engine.hf.model.layers[0].self_attn.q_proj.weight.dtype == FP8
    _old_load(monkeypatch)
    theirs = [
        _score(fp8_channel, "bf16", {})[1],
        _score(fp8_block, "fp32", {"weight_quant": "checkpoint:{model}", "act_quant": "fp8-tensor"})[1],
    ]
    for a, b in zip(ours, theirs):
        _assert_same(a, b)


def test_generate_equals_the_float32_load(fp8_block, monkeypatch):
    requests = [PromptRequest(sample_id=i, prompt_id=i, prompt_ids=[3 + i, 8, 12]) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)

    def generated(engine_args):
        engine = HFInferenceEngine(load_model_info(fp8_block), EngineConfig(dtype="bf16", engine_args=engine_args))
        return engine.generate(requests, params)

    ours = [generated({}), generated({"weight_quant": "dequantized"})]
    _old_load(monkeypatch)
    theirs = [generated({}), generated({"weight_quant": "dequantized"})]
    for a_run, b_run in zip(ours, theirs):
        for a, b in zip(a_run, b_run, strict=True):
            assert np.array_equal(a.token_ids, b.token_ids) and _same_bits(a.logprob, b.logprob)


def test_another_model_quantized_by_the_checkpoint(fp8_block, monkeypatch):
    """`--model PLAIN --engine-arg weight_quant=checkpoint:FP8`: the plain model's quantized parameters take the
    checkpoint's codes (kernel path too), as the float32 load gave them."""
    plain = fp8_block.parent / "plain"
    args = [
        {"weight_quant": f"checkpoint:{fp8_block}"},
        {"weight_quant": f"checkpoint:{fp8_block}", "quant_compute": "kernel"},
    ]
    engine, emulated = _score(plain, "bf16", args[0])
    assert engine.hf.get_submodule("model.layers.0.mlp.experts").down_proj.dtype == FP8
    ours = [emulated, _score(plain, "fp32", args[1])[1]]
    _old_load(monkeypatch)
    reference, old = _score(plain, "bf16", args[0])
    assert reference.hf.get_submodule("model.layers.0.mlp.experts").down_proj.dtype == torch.bfloat16
    theirs = [old, _score(plain, "fp32", args[1])[1]]
    for a, b in zip(ours, theirs):
        _assert_same(a, b)


def test_an_fp8_tensor_it_cannot_place_loads_the_float32_way(fp8_block, monkeypatch):
    """Where an fp8 tensor reaches a parameter the codes loader does not map (as Mixtral's `block_sparse_moe`
    experts reach `mlp.experts`), the model is not left holding raw codes: it loads the float32 way."""
    import mismatch_probe.quant.checkpoint_codes as codes_module

    known = codes_module.stored_quantized
    monkeypatch.setattr(
        codes_module, "stored_quantized", lambda name, names: "experts" not in name and known(name, names)
    )
    engine, ours = _score(fp8_block, "bf16", {"weight_quant": "dequantized"})
    assert not any(p.dtype == FP8 for p in engine.hf.parameters())
    _old_load(monkeypatch)
    _assert_same(ours, _score(fp8_block, "bf16", {"weight_quant": "dequantized"})[1])
