"""The transformers engines: routing capture, R3 replay, chunked log-probs, temperature and position alignment."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from conftest import SGLANG_FIXTURE

from mismatch_probe.engines import inference_engine, training_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.forward.logprobs import gather_logprobs, logprobs_from_logits
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.engines.hf.routing import RouterTap
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset


def _requests(rng, n=3, vocab=96):
    out = []
    for i in range(n):
        length = 9 + 4 * i
        out.append(ScoreRequest(i, i, rng.integers(2, vocab, length), prompt_len=4 + i))
    return out


def test_tap_captures_what_the_router_chose(tiny_moe):
    info = load_model_info(tiny_moe)
    assert info.moe_layer_indices == (0, 2)
    hf = load_hf_model(info, "fp32")
    tap = RouterTap(hf, info)
    seen = []  # an independent hook: the router's own output, and a recomputation from its input
    for router in tap.routers:

        def hook(module, inputs, output):
            probs = torch.softmax(torch.nn.functional.linear(inputs[0].reshape(-1, 64), module.weight), -1)
            seen.append((output[2].clone(), probs.topk(module.top_k, dim=-1).indices))

        router.register_forward_hook(hook)
    ids = torch.randint(2, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    hf(input_ids=ids)
    assert len(tap.layer_calls()) == 2 and len(seen) == 2
    for calls, (own, recomputed) in zip(tap.layer_calls(), seen):
        assert torch.equal(calls[0], own)
        assert torch.equal(calls[0], recomputed)
        assert calls[0].shape == (22, 2)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_replaying_own_routing_is_bitwise_identical(tiny_moe, dtype):
    info = load_model_info(tiny_moe)
    engine = training_engine("hf", info, EngineConfig(dtype=dtype))
    batch = _requests(np.random.default_rng(1))
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    replayed_batch = [
        ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len, f.experts, np.ones(len(r), bool))
        for r, f in zip(batch, free)
    ]
    replayed = engine.score(replayed_batch, ScoreOptions(temperature=1.0))
    for f, r in zip(free, replayed):
        assert np.array_equal(f.logprob, r.logprob)  # bitwise, not approximately
        assert np.array_equal(f.experts, r.experts)


def test_replay_forces_other_experts(tiny_moe):
    info = load_model_info(tiny_moe)
    engine = training_engine("hf", info, EngineConfig(dtype="fp32"))
    rng = np.random.default_rng(2)
    batch = _requests(rng)
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    forced = []
    for r in batch:
        ids = np.stack([rng.permutation(8)[:2] for _ in range(len(r) * 2)]).reshape(len(r), 2, 2)
        valid = np.ones(len(r), bool)
        valid[-1] = False  # no replay data: the engine keeps its own choice there
        forced.append(ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len, ids, valid))
    out = engine.score(forced, ScoreOptions(temperature=1.0, extra_padding=3))
    for req, got, own in zip(forced, out, free):
        np.testing.assert_array_equal(got.experts[:-1], req.replay_experts[:-1])
        # Without replay data the router chooses freely (its input changed, so its choice may too).
        assert all(len(set(layer.tolist())) == 2 for layer in got.experts[-1])
        assert not np.allclose(got.logprob[req.prompt_len :], own.logprob[req.prompt_len :], atol=1e-6)


def test_chunked_gather_equals_plain_log_softmax():
    torch.manual_seed(0)
    hidden, head = torch.randn(37, 16), torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (37,))
    for temperature in (1.0, 0.7):
        lp, top, top_lp = gather_logprobs(hidden, targets, head, temperature, chunk=5)
        full = torch.log_softmax(head(hidden) / temperature, dim=-1)
        torch.testing.assert_close(lp, full[torch.arange(37), targets], rtol=0, atol=1e-6)
        torch.testing.assert_close(top_lp, full.max(-1).values, rtol=0, atol=1e-6)
        assert torch.equal(top, full.argmax(-1))


def test_temperature_scales_logits_before_log_softmax():
    logits = torch.tensor([[2.0, 1.0, -1.0]])
    lp, _, _ = logprobs_from_logits(logits, torch.tensor([1]), 0.5)
    expected = 2.0 - np.log(np.exp(4.0) + np.exp(2.0) + np.exp(-2.0))  # log_softmax(logits / 0.5)[1]
    assert lp.item() == pytest.approx(expected, abs=1e-6)
    assert SamplingParams(temperature=0.0).scoring_temperature == 1.0  # greedy is scored at T = 1


@pytest.mark.parametrize("name,temperature", [("resp_greedy.json", 1.0), ("resp_temp.json", 0.7)])
def test_training_engine_reproduces_recorded_sglang(sglang_model, name, temperature):
    response = json.loads((SGLANG_FIXTURE / name).read_text())
    meta = response["meta_info"]
    tokens = np.array(list(range(10, 30)) + response["output_ids"])
    engine = training_engine("hf", load_model_info(sglang_model), EngineConfig(dtype="fp32"))
    [rec] = engine.score([ScoreRequest(0, 0, tokens, 20)], ScoreOptions(temperature=temperature))
    sglang_lp = np.array([entry[0] for entry in meta["output_token_logprobs"]])
    assert np.abs(rec.logprob[20:] - sglang_lp).max() <= 1e-4
    routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").reshape(-1, 2, 2)
    start = 15 if name == "resp_temp.json" else 0  # that request set routed_experts_start_len 15
    assert len(routed) == len(tokens) - 1 - start
    np.testing.assert_array_equal(rec.experts[start : len(tokens) - 1], routed)


def test_generate_routing_alignment_and_dense(tiny_moe, tiny_dense):
    info = load_model_info(tiny_moe)
    gen = inference_engine("hf", info, EngineConfig(dtype="fp32"))
    prompts = [PromptRequest(0, 0, [5, 6, 7, 8, 9]), PromptRequest(1, 1, [11, 12])]
    records = gen.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    train = training_engine("hf", info, EngineConfig(dtype="fp32"))
    scored = train.score(
        [ScoreRequest(r.sample_id, 0, r.token_ids, r.prompt_len) for r in records], ScoreOptions(temperature=1.0)
    )
    for rec, sc in zip(records, scored):
        n = len(rec)
        assert rec.experts_valid.tolist() == [True] * (n - 1) + [False]  # last sampled token never forwarded
        np.testing.assert_array_equal(rec.experts[:-1], sc.experts[:-1])
        np.testing.assert_allclose(rec.logprob[rec.prompt_len :], sc.logprob[rec.prompt_len :], atol=1e-4)
        assert rec.logprob_valid.tolist() == [False] * rec.prompt_len + [True] * (n - rec.prompt_len)
    dense = inference_engine("hf", load_model_info(tiny_dense), EngineConfig(dtype="bf16"))
    [rec] = dense.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert rec.experts is None and len(rec) == 9
