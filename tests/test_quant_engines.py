"""Fake quantization in the hf engines (issue 40, part 1): which modules the demo MoE model quantizes, the
skip list, the activation hooks, a quantized rescore and its manifest, and the refusal of bad values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf.training import HFTrainingOptions
from mismatch_probe.engines.options import build_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.quant import schemes
from mismatch_probe.quant.apply import dequantized_weight, quantize_model
from mismatch_probe.quant.targets import DEFAULT_SKIP, parse_skip

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
LAYERS = range(4)
ATTENTION = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in LAYERS for p in "qkvo"]
EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in LAYERS for p in ("gate_up_proj", "down_proj")]
ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in LAYERS]


def demo_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MOE, dtype=torch.float32).eval()


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_default_skip_keeps_routers_and_lm_head():
    model = demo_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    entry = quantize_model(model, "fp8-block128", None, DEFAULT_SKIP)
    assert entry["quantized_modules"] == sorted(ATTENTION + EXPERTS)
    assert entry["skipped_modules"] == sorted([*ROUTERS, "lm_head.weight"])
    assert (entry["weight"], entry["act"], entry["kv"]) == ("fp8-block128", None, None)
    after = dict(model.named_parameters())
    for name, old in before.items():
        if name in entry["quantized_modules"]:  # the model holds its e4m3 codes, not a copy in the run's dtype
            assert after[name].dtype == torch.float8_e4m3fn and after[name].shape == old.shape, name
        else:
            assert torch.equal(old, after[name]), name  # embeddings, norms, routers untouched
    # every matrix of this model fits one 128x128 block: each expert's gate and up halves hold their own scale
    gate_up = before["model.layers.0.mlp.experts.gate_up_proj"]
    expected = torch.cat([schemes.fp8_tensor(gate_up[:, :64]), schemes.fp8_tensor(gate_up[:, 64:])], dim=1)
    assert torch.equal(dequantized_weight(model, "model.layers.0.mlp.experts.gate_up_proj"), expected)


def test_an_empty_skip_list_quantizes_routers_and_lm_head():
    assert parse_skip("") == () and parse_skip(None) == parse_skip("default") == DEFAULT_SKIP
    model = demo_model()
    embeddings = model.get_input_embeddings().weight.detach().clone()
    entry = quantize_model(model, "fp8-block128", None, parse_skip(""))
    assert entry["quantized_modules"] == sorted(ATTENTION + EXPERTS + ROUTERS + ["lm_head.weight"])
    assert entry["skipped_modules"] == []
    assert torch.equal(model.get_input_embeddings().weight, embeddings)
    assert parse_skip("lm_head, q_proj") == ("lm_head", "q_proj")


def test_act_quant_reaches_linears_and_each_expert_product():
    ids = torch.tensor([[5, 9, 33, 2, 70, 11, 4]])
    plain = demo_model()
    act_only = demo_model()
    entry = quantize_model(act_only, None, "fp8-token128", DEFAULT_SKIP)
    assert entry["weight"] is None and entry["act"] == "fp8-token128"
    q_proj = act_only.get_submodule("model.layers.0.self_attn.q_proj")
    seen = {}
    q_proj.register_forward_hook(lambda m, a, out: seen.update(x=a[0], y=out))  # after ours: the module's output
    assert not act_only.get_submodule("model.layers.0.mlp.gate")._forward_pre_hooks  # a skipped router: no quant
    with torch.no_grad():
        a, b = plain(ids).logits, act_only(ids).logits
    assert not torch.equal(a, b)
    # the input is quantized inside the product, in float32, with the weight as loaded
    expected = torch.nn.functional.linear(schemes.fp8_token128(seen["x"].float()), q_proj.weight.float())
    assert torch.equal(seen["y"], expected.to(seen["y"].dtype))
    assert not torch.equal(seen["y"], torch.nn.functional.linear(seen["x"], q_proj.weight))
    # the experts: quantizing their weights only (no act) differs from act on top
    w_only, w_act = demo_model(), demo_model()
    quantize_model(w_only, "fp8-block128", None, ("mlp.gate.", "lm_head", "self_attn"))
    quantize_model(w_act, "fp8-block128", "fp8-token128", ("mlp.gate.", "lm_head", "self_attn"))
    with torch.no_grad():
        assert not torch.equal(w_only(ids).logits, w_act(ids).logits)


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("weight_quant", "fp9", "none, fp8-block128, fp8-channel, fp8-tensor, mxfp8, nvfp4, int4-g128"),
        ("act_quant", "int8", "none, fp8-token128, fp8-token, fp8-tensor"),
        ("quant_compute", "fast", "auto, emulate, kernel"),
    ],
)
def test_bad_values_are_refused_with_one_line(key, value, allowed):
    message = f"--engine-arg {key}={value}: expected one of {allowed}"
    with pytest.raises(ProbeError) as caught:
        build_options(HFTrainingOptions, "hf", {key: value})
    assert str(caught.value) == message
    result = probe("rescore", "/nonexistent-run", "--engine-arg", f"{key}={value}")
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}"


def test_the_kernel_path_needs_fp8_weights_and_activations():
    message = (
        "--engine-arg quant_compute=kernel: the kernel path needs an fp8 weight_quant "
        "(fp8-block128, fp8-channel, fp8-tensor) and an act_quant, or int4-g128 (Marlin's arithmetic)"
    )
    for args in (["weight_quant=fp8-block128"], ["weight_quant=mxfp8", "act_quant=fp8-token128"]):
        engine_args = [a for arg in [*args, "quant_compute=kernel"] for a in ("--engine-arg", arg)]
        result = probe("rescore", "/nonexistent-run", *engine_args)
        assert (result.exit_code, result.output.strip()) == (2, f"error: {message}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(6)) + "\n")
    run = root / "run"
    args = ["--prompts", prompts, "--out", run, "--max-new-tokens", 12, "--seed", 3, "--dtype", "fp32"]
    assert probe("generate", "--model", DEMO_MOE, *args).exit_code == 0
    assert probe("rescore", run, "--dtype", "fp32", "--name", "plain").exit_code == 0
    result = probe("rescore", run, "--dtype", "fp32", "--name", "fp8", "--engine-arg", "weight_quant=fp8-block128")
    assert result.exit_code == 0, result.output
    return run


def test_a_quantized_rescore_changes_logprobs_and_its_manifest_says_so(demo_run):
    def side(name):
        frame = pl.read_parquet(demo_run / "scores" / name / "*.parquet").sort("sample_id", "position")
        return frame.filter(pl.col("logprob").is_not_null())["logprob"].to_numpy()

    plain, fp8 = side("plain"), side("fp8")
    assert plain.shape == fp8.shape and not np.array_equal(plain, fp8)
    assert np.median(np.abs(plain - fp8)) < 0.05  # fake quant perturbs, it does not scramble
    manifest = json.loads((demo_run / "scores" / "fp8" / "manifest.json").read_text())
    quant = manifest["quantization"]
    assert (quant["weight"], quant["act"], quant["kv"], quant["compute"]) == ("fp8-block128", None, None, "emulate")
    assert quant["quantized_modules"] == sorted(ATTENTION + EXPERTS)
    assert quant["skipped_modules"] == sorted([*ROUTERS, "lm_head.weight"])
    assert json.loads((demo_run / "scores" / "plain" / "manifest.json").read_text())["quantization"] is None
    assert json.loads((demo_run / "manifest.json").read_text())["quantization"] is None
    fingerprints = [
        json.loads((demo_run / "scores" / n / "manifest.json").read_text())["engine"]["weights_fingerprint"]
        for n in ("plain", "fp8")
    ]
    assert fingerprints[0] == fingerprints[1]  # the checkpoint's weights, not the quantized ones
