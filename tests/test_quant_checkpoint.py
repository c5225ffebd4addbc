"""FP8 checkpoints (issue 47, part 3): a DeepSeek-V3 / Qwen3-FP8 layout made here (e4m3 weights, 128x128
`weight_scale_inv` blocks scaled by random factors, so that re-quantizing the dequantized weights would not
give them back), read exactly by `weight_quant=checkpoint:PATH`, and loaded directly by generate and rescore."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.quant import schemes
from mismatch_probe.quant.apply import dequantized_weight, quantize_model
from mismatch_probe.quant.targets import DEFAULT_SKIP

BLOCK = 128
KEPT = "model.layers.1.mlp.down_proj.weight"  # stored unquantized: stays unquantized


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def fp8_block(w: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale_inv [ceil(out/128), ceil(in/128)], the dequantized weight codes x scale_inv in
    float32, computed element by element from the stored tensors)."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale_inv = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            amax = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].abs().max()
            scale_inv[i, j] = amax / 448 * (1 + 2 * torch.rand((), generator=generator))  # not absmax / 448
    full = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    codes = (w / full).to(torch.float8_e4m3fn)
    expected = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(0, cols, BLOCK):  # explicit: each element's code times its block's scale_inv
            expected[i, j : j + BLOCK] = codes[i, j : j + BLOCK].float() * scale_inv[i // BLOCK, j // BLOCK]
    return codes, scale_inv, expected


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the bf16 model's folder, the FP8 checkpoint's folder, {name: expected dequantized weight})."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, intermediate_size=384, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("fp8")
    plain = root / "plain"
    Qwen3MoeForCausalLM(config).save_pretrained(plain)
    state = load_file(plain / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    stored, expected = {}, {}
    for name, tensor in state.items():
        linear = name.endswith("proj.weight") and tensor.dim() == 2
        if not linear or name == KEPT:
            stored[name] = tensor
            continue
        codes, scale_inv, expected[name] = fp8_block(tensor.float(), generator)
        stored[name], stored[f"{name}_scale_inv"] = codes, scale_inv
    fp8 = root / "fp8"
    fp8.mkdir()
    save_file(stored, fp8 / "model.safetensors")
    raw = json.loads((plain / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
        "activation_scheme": "dynamic",
    }
    (fp8 / "config.json").write_text(json.dumps(raw))
    return plain, fp8, expected


def test_the_checkpoints_codes_and_scales_are_read_exactly(checkpoint):
    from transformers import AutoModelForCausalLM

    plain, fp8, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    entry = quantize_model(model, f"checkpoint:{fp8}", None, DEFAULT_SKIP)
    assert (entry["weight"], entry["act"], entry["compute"]) == (f"checkpoint:{fp8}", "fp8-token128", "emulate")
    assert KEPT in entry["skipped_modules"] and "model.layers.0.mlp.gate.weight" in entry["skipped_modules"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in entry["quantized_modules"]
    # each attention projection computes with the checkpoint's dequantized weight, exactly (float32 run)
    x = torch.randn(5, 256)
    for p in ("q", "k", "v", "o"):
        module = model.get_submodule(f"model.layers.0.self_attn.{p}_proj")
        w = expected[f"model.layers.0.self_attn.{p}_proj.weight"]
        assert module.weight.dtype == torch.float8_e4m3fn  # the checkpoint's codes, one byte an element
        assert torch.equal(dequantized_weight(model, f"model.layers.0.self_attn.{p}_proj.weight"), w)
        xin = x[:, : w.shape[1]]
        assert torch.equal(module(xin), torch.nn.functional.linear(schemes.fp8_token128(xin), w))
        assert not torch.equal(schemes.fp8_block128(w), w)  # re-quantization would not give them back
    # the fused experts hold each expert's gate and up weights, in that order, and its down weight
    gate_up, down = (
        dequantized_weight(model, f"model.layers.0.mlp.experts.{p}") for p in ("gate_up_proj", "down_proj")
    )
    for e in range(4):
        gate, up = (expected[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(gate_up[e], torch.cat([gate, up]))
        assert torch.equal(down[e], expected[f"model.layers.0.mlp.experts.{e}.down_proj.weight"])
    kept = model.get_submodule("model.layers.1.mlp.down_proj")
    assert not kept._forward_pre_hooks  # stored unquantized: computes as loaded
    # the kernel path (torch._scaled_mm, which this torch build runs on the CPU) reads the checkpoint's own
    # codes and scales into the model's layout: the same products up to float32 summation order
    kernel = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert quantize_model(kernel, f"checkpoint:{fp8}", None, DEFAULT_SKIP, compute="kernel")["compute"] == "kernel"
    ids = torch.tensor([[5, 9, 33, 2, 70, 11, 4, 8]])
    with torch.no_grad():
        torch.testing.assert_close(kernel(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_generate_and_rescore_load_the_checkpoint_directly(checkpoint, tmp_path):
    plain, fp8, _ = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(3)) + "\n")
    run, twin = tmp_path / "run", tmp_path / "twin"
    common = ("--dtype", "fp32", "--engine", "hf", "--prompts", prompts, "--max-new-tokens", 8)
    result = probe("generate", "--model", fp8, "--out", run, *common)
    assert result.exit_code == 0, result.output
    result = probe("rescore", run, "--model", fp8, "--dtype", "fp32", "--name", "ckpt")
    assert result.exit_code == 0, result.output
    # the bf16 model's rollout with the checkpoint's weights: the same rollout
    result = probe(
        "generate", "--model", plain, "--out", twin, *common, "--engine-arg", f"weight_quant=checkpoint:{fp8}"
    )
    assert result.exit_code == 0, result.output
    entries = [json.loads((r / "manifest.json").read_text())["quantization"] for r in (run, twin)]
    entries.append(json.loads((run / "scores" / "ckpt" / "manifest.json").read_text())["quantization"])
    for q in entries:  # every side records the same scheme: the report pairs them
        assert (q["weight"], q["act"], q["compute"]) == (f"checkpoint:{fp8.resolve()}", "fp8-token128", "emulate")

    def side(path):
        frame = pl.read_parquet(path).sort("sample_id", "position")
        return frame.filter(pl.col("logprob").is_not_null())["logprob"].to_numpy()

    rollout, ckpt = side(run / "rollout" / "*.parquet"), side(run / "scores" / "ckpt" / "*.parquet")
    np.testing.assert_array_equal(rollout, side(twin / "rollout" / "*.parquet"))
    # decode against prefill in fp32: at the fp32 floor, but for a rare e4m3 rounding of an activation that
    # the fp32 noise tips over (1.6e-4 once in this run)
    assert np.median(np.abs(rollout - ckpt)) < 1e-5 and np.abs(rollout - ckpt).max() < 1e-3


def test_a_folder_without_fp8_config_is_refused(checkpoint):
    plain, _, _ = checkpoint
    result = probe("rescore", "/nonexistent-run", "--engine-arg", f"weight_quant=checkpoint:{plain}")
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: --engine-arg weight_quant=checkpoint:{plain}: config.json has no fp8 quantization_config"
    )


def test_per_tensor_and_per_channel_weight_scales(tmp_path):
    """AutoFP8 / llm-compressor: `X.weight_scale`, one value or one per output row; `input_scale` not read."""
    from mismatch_probe.quant.checkpoint import dequantized_state_dict, read_fp8_checkpoint

    codes = (torch.randn(6, 10) * 100).to(torch.float8_e4m3fn)
    rows = torch.rand(6, 1) + 0.1
    save_file(
        {
            "a.weight": codes, "a.weight_scale": torch.tensor(0.37), "a.input_scale": torch.tensor(2.0),
            "b.weight": codes.clone(), "b.weight_scale": rows, "norm.weight": torch.ones(10),
        },
        tmp_path / "model.safetensors",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    ckpt = read_fp8_checkpoint(tmp_path)
    assert (ckpt.scheme, ckpt.act, ckpt.label) == ("fp8-tensor", "fp8-tensor", f"checkpoint:{tmp_path.resolve()}")
    state, quantized = dequantized_state_dict(ckpt)
    assert quantized == {"a.weight", "b.weight"} and set(state) == {"a.weight", "b.weight", "norm.weight"}
    for i in range(6):
        for j in range(10):
            assert state["a.weight"][i, j].item() == np.float32(codes[i, j].float().item()) * np.float32(0.37)
            assert state["b.weight"][i, j].item() == np.float32(codes[i, j].float().item() * rows[i, 0].item())


@pytest.mark.slow
def test_an_fp8_checkpoint_rollout_gets_its_plain_pass_and_quant_share(checkpoint, tmp_path):
    """A rollout of an FP8 checkpoint: its matched pass loads the checkpoint as it is; its plain pass is
    weight_quant=dequantized (the same weights, products unquantized), which the report's missing line asks for;
    with both, quant_share is measured."""
    _, fp8, _ = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(4)) + "\n")
    run = tmp_path / "run"
    common = ("--dtype", "bf16", "--engine", "hf")
    result = probe("generate", "--model", fp8, "--out", run, *common, "--prompts", prompts, "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    assert probe("rescore", run, *common, "--name", "matched").exit_code == 0
    assert probe("report", run).exit_code == 0
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    missing = " ".join(metrics["attribution"]["missing"])
    assert "--engine-arg weight_quant=dequantized` where the run has none" in missing
    result = probe("rescore", run, *common, "--engine-arg", "weight_quant=dequantized", "--name", "plain")
    assert result.exit_code == 0, result.output
    assert json.loads((run / "scores" / "plain" / "manifest.json").read_text())["quantization"] is None
    assert probe("report", run).exit_code == 0
    shares = json.loads((run / "report" / "metrics.json").read_text())["attribution"]["quant_share"]
    assert [(s["plain"], s["matched"]) for s in shares] == [("scores/plain", "scores/matched")]
    assert shares[0]["share"] is not None


def test_dequantized_loads_the_checkpoints_weights_as_plain_weights(checkpoint):
    from mismatch_probe.engines.hf.model import load_hf_model
    from mismatch_probe.engines.hf.quant_options import QuantOptions
    from mismatch_probe.model.routing_shape import load_model_info

    _, fp8, expected = checkpoint
    model = load_hf_model(load_model_info(fp8), "fp32")
    assert QuantOptions(weight_quant="dequantized").quantize(model, fp8) is None
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.get_parameter(name), expected[name])
    assert not model.get_submodule("model.layers.0.self_attn.q_proj")._forward_pre_hooks


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_generate_from_the_fp8_checkpoint_stops_at_generation_config_s_end_ids(checkpoint, tmp_path):
    """config.json names end id 1; generation_config.json adds others. The FP8 checkpoint's rollout stops at each
    of them, as the bf16 model's does, and both manifests record the end ids that applied."""
    ends = [1, *range(40, 52)]  # a dozen ids more: about one token in eight of this random model is an end id
    models = {}
    for name, folder in zip(("bf16", "fp8"), checkpoint[:2]):
        models[name] = Path(shutil.copytree(folder, tmp_path / f"model-{name}"))
        (models[name] / "generation_config.json").write_text(json.dumps({"eos_token_id": ends, "pad_token_id": 1}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 60 + i, 5 * i + 2]}) for i in range(6)) + "\n")
    runs = {}
    for name, model in models.items():
        runs[name] = tmp_path / name
        result = probe(
            "generate", "--model", model, "--out", runs[name], "--engine", "hf", "--dtype", "bf16",
            "--prompts", prompts, "--samples-per-prompt", 4, "--max-new-tokens", 24, "--temperature", 1,
            "--batch-size", 1,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    stopped = 0
    for name, run in runs.items():
        assert json.loads((run / "manifest.json").read_text())["eos_token_ids"] == ends, name
        frame = pl.read_parquet(run / "rollout" / "*.parquet").filter("is_response").sort("sample_id", "position")
        for (sample,), rows in frame.group_by(["sample_id"]):
            tokens = rows["token_id"].to_list()
            inside = [i for i, t in enumerate(tokens) if t in ends]
            assert inside in ([], [len(tokens) - 1]), f"{name} sample {sample} goes on past an end id: {tokens}"
            stopped += bool(inside) and tokens[-1] != 1
    assert stopped >= 4  # the ids only generation_config.json names did stop samples, in both runs
