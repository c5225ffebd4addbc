"""`--engine-arg kv_quant=fp8` (issue 40): every attention call, the prefill's included, reads K and V rounded to
e4m3fn with scale 1.0; another model loaded beside it is untouched, bit for bit; the manifest says `kv: fp8`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from transformers import AttentionInterface
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.quant.apply import quantize_model
from mismatch_probe.quant.kv import round_kv_fp8
from mismatch_probe.quant.targets import DEFAULT_SKIP

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
IDS = torch.tensor([[5, 9, 33, 2, 70, 11, 4, 100, 3]])


def demo_model(dtype=torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MOE, dtype=dtype).eval()


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def e4m3_exact(x: torch.Tensor) -> bool:
    """Every value is one of e4m3fn's (a direct check: the cast and back changes nothing, |x| <= 448)."""
    as_float = x.float()
    return bool((as_float.abs() <= 448).all()) and torch.equal(as_float.to(torch.float8_e4m3fn).float(), as_float)


@pytest.fixture
def seen(monkeypatch):
    """What reaches sdpa: the (key, value) of every attention call."""
    calls = []
    original = AttentionInterface._global_mapping["sdpa"]

    def spy(module, query, key, value, *args, **kwargs):
        calls.append((key.detach().clone(), value.detach().clone()))
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_rounded_keys_and_values(seen, dtype):
    model = demo_model(dtype)
    assert model.config._attn_implementation == "sdpa"
    entry = quantize_model(model, None, None, DEFAULT_SKIP, kv="fp8")
    assert entry == {"weight": None, "act": None, "kv": "fp8", "quantized_modules": [], "skipped_modules": []}
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=4, do_sample=False, top_k=0, top_p=1.0)
    assert out.shape[1] > IDS.shape[1]
    assert len(seen) >= 4 * 2  # the prefill and decode steps of each of the 4 layers
    assert seen[0][0].shape[-2] == IDS.shape[1]  # the first call is the prompt's prefill
    for key, value in seen:
        assert key.dtype == dtype and e4m3_exact(key) and e4m3_exact(value)


def test_logprobs_change_with_kv_quant_and_not_without(seen):
    plain_before = demo_model()
    with torch.no_grad():
        reference = plain_before(IDS).logits
    assert not all(e4m3_exact(k) for k, _ in seen)  # unrounded keys reach the plain model's attention
    quantized = demo_model()
    quantize_model(quantized, None, None, DEFAULT_SKIP, kv="fp8")
    untouched = demo_model()  # loaded after the wrapper was registered: it must not use it
    assert quantize_model(untouched, None, None, DEFAULT_SKIP, kv=None) is None
    with torch.no_grad():
        rounded, again = quantized(IDS).logits, untouched(IDS).logits
    assert torch.equal(again, reference)
    assert not torch.equal(rounded, reference)
    assert (rounded - reference).abs().median() < 0.5  # rounding perturbs, it does not scramble
    # the same as rounding K and V by hand: the rounded K equals the plain K rounded
    seen.clear()
    with torch.no_grad():
        plain_before(IDS)
        quantized(IDS)
    layers = len(seen) // 2
    for (k_plain, v_plain), (k_q, v_q) in zip(seen[:1], seen[layers : layers + 1]):  # layer 0: same input
        assert torch.equal(round_kv_fp8(k_plain), k_q) and torch.equal(round_kv_fp8(v_plain), v_q)


def test_rescore_and_generate_with_kv_quant(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(4)) + "\n")
    run = tmp_path / "run"
    args = ["--prompts", prompts, "--out", run, "--max-new-tokens", 8, "--dtype", "fp32"]
    result = probe("generate", "--model", DEMO_MOE, *args, "--engine-arg", "kv_quant=fp8")
    assert result.exit_code == 0, result.output
    assert json.loads((run / "manifest.json").read_text())["quantization"]["kv"] == "fp8"
    for name, extra in (("plain", ()), ("kv", ("--engine-arg", "kv_quant=fp8"))):
        result = probe("rescore", run, "--dtype", "fp32", "--name", name, *extra)
        assert result.exit_code == 0, result.output

    def side(name):
        frame = pl.read_parquet(run / "scores" / name / "*.parquet").sort("sample_id", "position")
        return frame.filter(pl.col("logprob").is_not_null())["logprob"].to_numpy()

    assert not np.array_equal(side("plain"), side("kv"))
    manifest = json.loads((run / "scores" / "kv" / "manifest.json").read_text())
    assert manifest["quantization"]["kv"] == "fp8" and manifest["quantization"]["weight"] is None
    assert json.loads((run / "scores" / "plain" / "manifest.json").read_text())["quantization"] is None
    result = probe("rescore", run, "--engine-arg", "kv_quant=int8")
    assert result.exit_code == 2 and "--engine-arg kv_quant=int8: expected one of none, fp8" in result.output
