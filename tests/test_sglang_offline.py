"""`sglang-offline` against the recorded SGLang 0.5.23 answers, fed through a stand-in `sglang`
module (tests/fake_sglang.py). SGLang itself cannot run on these machines: these tests check the
arguments the engine passes and that its records equal the HTTP `sglang` engine's on the same
answers; they are not a live test of SGLang.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from fake_sglang import FakeEngine, fake_sglang_module
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes
from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.sglang_fields import sampling_fields
from mismatch_probe.engine_args import engine_help
from mismatch_probe.errors import ProbeError
from mismatch_probe.modelinfo import load_model_info
from mismatch_probe.records import PromptRequest

MODEL = load_model_info(FIXTURE_MODEL)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)
PROMPTS = [PromptRequest(7, 3, FIXTURE_PROMPT), PromptRequest(8, 4, [40, 41, 42])]
FIELDS = ("token_ids", "logprob", "logprob_valid", "top_token_id", "top_logprob", "experts", "experts_valid")


@pytest.fixture
def sglang(monkeypatch):
    def install(**route_args):
        monkeypatch.setitem(sys.modules, "sglang", fake_sglang_module(**route_args))
    install()
    return install


def offline(dtype: str = "fp32", **args):
    return inference_engine("sglang-offline", MODEL, EngineConfig(dtype=dtype, engine_args=args))


def http_records(params: SamplingParams):
    with ReplayServer(sglang_routes()) as server:
        args = {"server_url": server.url, "timeout_s": 5.0, "max_retries": 1}
        engine = inference_engine("sglang", MODEL, EngineConfig(engine_args=args))
        engine.check_ready(params)
        return engine.generate(PROMPTS, params)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.7, max_new_tokens=3, seed=4)])
def test_records_equal_the_http_engine_on_the_same_answers(sglang, params):
    engine = offline()
    engine.check_ready(params)
    records = engine.generate(PROMPTS, params)
    for got, want in zip(records, http_records(params), strict=True):
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert got.prompt_len == want.prompt_len and got.sample_id == want.sample_id
    assert records[0].experts_valid.sum() == len(records[0]) - 1  # every forwarded position routed


def test_engine_and_generate_arguments(sglang):
    engine = offline(dtype="bf16", tp_size="2", mem_fraction_static="0.5")
    engine.check_ready(GREEDY)
    engine.generate(PROMPTS, GREEDY)
    [fake] = [e for e in FakeEngine.instances if e is engine.engine]
    assert fake.kwargs == {
        "model_path": str(FIXTURE_MODEL), "dtype": "bfloat16", "tp_size": 2, "dp_size": 1, "ep_size": 1,
        "mem_fraction_static": 0.5, "disable_radix_cache": True, "enable_deterministic_inference": True,
        "random_seed": 0, "log_level": "error", "enable_return_routed_experts": True,
    }
    call = fake.calls[-1]
    assert call["input_ids"] == [FIXTURE_PROMPT, [40, 41, 42]]
    assert call["sampling_params"] == [sampling_fields(GREEDY, 7), sampling_fields(GREEDY, 8)]
    assert call["sampling_params"][0]["sampling_seed"] != call["sampling_params"][1]["sampling_seed"]
    assert (call["return_logprob"], call["logprob_start_len"], call["top_logprobs_num"]) == (True, -1, 1)
    assert (call["return_routed_experts"], call["routed_experts_start_len"]) == (True, 0)
    info = engine.describe()
    assert info["engine"] == "sglang-offline" and info["dtype"] == "bf16" and info["sglang_version"] == "0.5.23"
    assert info["engine_args"]["tp_size"] == 2 and info["warnings"] == []
    engine.close()
    assert fake.shut


def test_engine_without_routing_is_refused(sglang):
    sglang(routing=False)
    with pytest.raises(ProbeError, match="SGLang Engine does not return routed experts for this MoE model"):
        offline().check_ready(GREEDY)


def test_settings_that_make_routing_inexact_warn(sglang):
    engine = offline(disable_radix_cache="false", enable_deterministic_inference="no")
    engine.check_ready(GREEDY)
    warnings = engine.describe()["warnings"]
    assert len(warnings) == 2
    assert "set --engine-arg disable_radix_cache" in warnings[0]
    assert warnings[1].startswith("SGLang Engine does not report --engine-arg enable_deterministic_inference")


def test_missing_sglang_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ProbeError) as info:
        offline()
    assert info.value.exit_code == 2
    assert str(info.value) == (
        "--engine sglang-offline needs sglang, which is not installed: pip install 'mismatch-probe[sglang]'"
    )


def test_dtype_it_cannot_run_is_refused(sglang):
    with pytest.raises(ProbeError, match=r"--dtype fp32-bf16w: --engine sglang-offline runs bf16, fp16, fp32"):
        offline(dtype="fp32-bf16w")


def test_help_engine_lists_the_options():
    text = engine_help("inference", "sglang-offline")
    for key in ("tp_size", "dp_size", "ep_size", "mem_fraction_static", "attention_backend", "disable_radix_cache",
                "enable_deterministic_inference", "random_seed", "log_level"):
        assert f"\n  {key} " in text


def test_cli_without_sglang_exits_2_before_any_output(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    monkeypatch.setitem(sys.modules, "sglang", None)
    out = tmp_path / "run"
    args = ["generate", "--engine", "sglang-offline", "--model", str(FIXTURE_MODEL), "--prompts",
            str(tmp_path / "prompts.jsonl"), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    expected = "--engine sglang-offline needs sglang, which is not installed: pip install 'mismatch-probe[sglang]'"
    assert f"error: {expected}" in result.output
    assert not out.exists()
