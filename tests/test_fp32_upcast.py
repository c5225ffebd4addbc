"""fp32 passes of a bf16 checkpoint hold its bf16 parameters and upcast each module's weights while it runs
(engines/hf/upcast.py): the log-probs, router margins and generated tokens equal those of the model loaded in
fp32 bit for bit, and the loaded model holds no fp32 copy of its weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mismatch_probe.engines.hf.model as model_module
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.hf.inference import HFInferenceEngine
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.engines.hf.training import HFTrainingEngine
from mismatch_probe.engines.hf.upcast import computes_in_float32, stored_half_dtype
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest


def _save_bf16(source, path, tie: bool = False):
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bf16_moe(tiny_moe, tmp_path_factory):
    return _save_bf16(tiny_moe, tmp_path_factory.mktemp("bf16-moe"))


@pytest.fixture(scope="module")
def bf16_dense_tied(tiny_dense, tmp_path_factory):
    return _save_bf16(tiny_dense, tmp_path_factory.mktemp("bf16-dense"), tie=True)


BATCH = [
    ScoreRequest(sample_id=i, prompt_id=i, token_ids=np.random.default_rng(i).integers(2, 96, 9 + i), prompt_len=3)
    for i in range(3)
]


def _score(path, dtype="fp32", **engine_args):
    engine = HFTrainingEngine(load_model_info(path), EngineConfig(dtype=dtype, engine_args=engine_args))
    records = engine.score(BATCH, ScoreOptions(temperature=0.7))
    return engine, records


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def test_the_fp32_pass_holds_bf16_parameters(bf16_moe, tiny_moe):
    assert stored_half_dtype(bf16_moe) == torch.bfloat16
    assert stored_half_dtype(tiny_moe) is None  # stored in fp32: loaded in fp32 as before
    hf = load_hf_model(load_model_info(bf16_moe), "fp32")
    floating = [p for p in hf.parameters() if p.is_floating_point()]
    assert computes_in_float32(hf) and {p.dtype for p in floating} == {torch.bfloat16}
    with torch.no_grad():
        logits = hf(torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.dtype == torch.float32
    assert {p.dtype for p in hf.parameters() if p.is_floating_point()} == {torch.bfloat16}  # put back after
    held = sum(p.numel() * p.element_size() for p in floating)
    assert held == sum(p.numel() for p in floating) * 2  # one bf16 copy: half of what fp32 parameters hold
    plain = load_hf_model(load_model_info(tiny_moe), "fp32")
    assert not computes_in_float32(plain) and {p.dtype for p in plain.parameters()} == {torch.float32}


def test_fp32_log_probs_and_margins_equal_an_fp32_load_bit_for_bit(bf16_moe, monkeypatch):
    engine, records = _score(bf16_moe)
    assert engine.describe()["lm_head_dtype"] == "fp32" and engine.describe()["router_dtype"] == "fp32"
    monkeypatch.setattr(model_module, "stored_half_dtype", lambda _path: None)
    reference, expected = _score(bf16_moe)
    assert {p.dtype for p in reference.hf.parameters()} == {torch.float32}
    for got, want in zip(records, expected):
        assert _same_bits(got.logprob, want.logprob)
        assert _same_bits(got.router_margin, want.router_margin)
        assert np.array_equal(got.experts, want.experts)


def test_fp32_knobs_and_tied_head_equal_an_fp32_load(bf16_dense_tied, bf16_moe, monkeypatch):
    """A tied head (dense) and the fp32 knobs on an fp32 pass (no-ops there), against the fp32 load."""
    got = [_score(bf16_dense_tied)[1], _score(bf16_moe, lm_head_dtype="fp32", router_dtype="fp32")[1]]
    monkeypatch.setattr(model_module, "stored_half_dtype", lambda _path: None)
    reference = [_score(bf16_dense_tied)[1], _score(bf16_moe, lm_head_dtype="fp32", router_dtype="fp32")[1]]
    for ours, theirs in zip(got, reference):
        assert all(_same_bits(a.logprob, b.logprob) for a, b in zip(ours, theirs))


def test_fp32_bf16w_equals_bf16_weights_made_fp32(tiny_moe):
    """fp32-bf16w of an fp32 checkpoint: bf16 parameters computing in fp32, equal to the old bf16-then-.float()."""
    hf = load_hf_model(load_model_info(tiny_moe), "fp32-bf16w")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    old = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.bfloat16).float().eval()
    tokens = torch.tensor([[5, 9, 2, 17, 33, 4], [7, 7, 8, 60, 2, 3]])
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, old(tokens).logits)


def test_fp32_generate_equals_an_fp32_load(bf16_moe, monkeypatch):
    requests = [PromptRequest(sample_id=i, prompt_id=i, prompt_ids=[3 + i, 8, 12]) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)

    def generated():
        engine = HFInferenceEngine(load_model_info(bf16_moe), EngineConfig(dtype="fp32"))
        return engine.generate(requests, params)

    ours = generated()
    monkeypatch.setattr(model_module, "stored_half_dtype", lambda _path: None)
    theirs = generated()
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.token_ids, b.token_ids) and _same_bits(a.logprob, b.logprob)
