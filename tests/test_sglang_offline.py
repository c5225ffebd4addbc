"""`sglang-offline` on SGLang 0.5.23's own `ServerArgs`, with a stand-in `sglang.Engine` answering
with recorded SGLang answers (tests/fake_sglang.py). SGLang's Engine itself cannot run on these
machines: these tests check the arguments the engine passes, what it reads back from SGLang's
settings, that its records equal the HTTP `sglang` engine's on the same answers, and how it reports
an Engine that does not start or dies; they are not a live test of SGLang.
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (the Makefile installs it; the lowest CI lane does not)")

import fake_sglang
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes
from fake_sglang import StandInEngine
from sglang.srt.server_args import ServerArgs
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.cli_args import engine_help
from mismatch_probe.engines.sglang.fields import RECORDED_ARGS, sampling_fields
from mismatch_probe.engines.sglang.start import start_failure
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

MODEL = load_model_info(FIXTURE_MODEL)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)
PROMPTS = [PromptRequest(7, 3, FIXTURE_PROMPT), PromptRequest(8, 4, [40, 41, 42])]
FIELDS = ("token_ids", "logprob", "logprob_valid", "top_token_id", "top_logprob", "experts", "experts_valid")
NOT_INSTALLED = "--engine sglang-offline needs sglang, which is not installed: pip install 'mismatch-probe[sglang]'"
BACKENDS = "['ascend', 'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton']"  # SGLang 0.5.23's deterministic ones


@pytest.fixture
def sglang(monkeypatch):
    """The stand-in Engine on the real sglang module; SIGQUIT's handler as it was afterwards."""
    before = signal.getsignal(signal.SIGQUIT)

    def install(**route_args):
        fake_sglang.install(monkeypatch.setattr, **route_args)

    install()
    yield install
    signal.signal(signal.SIGQUIT, before)


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
    [fake] = [e for e in StandInEngine.instances if e is engine.engine]
    handler = fake.kwargs.pop("custom_sigquit_handler")
    assert fake.kwargs == {
        "model_path": str(FIXTURE_MODEL),
        "dtype": "bfloat16",
        "tp_size": 2,
        "dp_size": 1,
        "ep_size": 1,
        "mem_fraction_static": 0.5,
        "disable_radix_cache": True,
        "enable_deterministic_inference": True,
        "random_seed": 0,
        "log_level": "error",
        "enable_return_routed_experts": True,
    }
    assert handler == engine.death.on_start_sigquit
    call = fake.calls[-1]
    assert call["input_ids"] == [FIXTURE_PROMPT, [40, 41, 42]]
    assert call["sampling_params"] == [sampling_fields(GREEDY, 7), sampling_fields(GREEDY, 8)]
    assert call["sampling_params"][0]["sampling_seed"] != call["sampling_params"][1]["sampling_seed"]
    assert (call["return_logprob"], call["logprob_start_len"], call["top_logprobs_num"]) == (True, -1, 1)
    assert (call["return_routed_experts"], call["routed_experts_start_len"]) == (True, 0)
    engine.close()
    assert fake.shut


def test_manifest_records_what_sglangs_server_args_hold(sglang):
    """SGLang's ServerArgs is a msgspec.Struct: `vars()` of it is empty, `resolved_dict()` has the values."""
    engine = offline(dtype="bf16", tp_size="2")
    assert type(engine.engine.server_args) is ServerArgs and vars(engine.engine.server_args) == {}
    engine.check_ready(GREEDY)
    info = engine.describe()
    assert info["engine"] == "sglang-offline" and info["dtype"] == "bf16" and info["sglang_version"] == "0.5.23"
    assert list(info["engine_args"]) == list(RECORDED_ARGS)
    assert {
        k: info["engine_args"][k]
        for k in (
            "model_path",
            "dtype",
            "tp_size",
            "disable_radix_cache",
            "enable_deterministic_inference",
            "kv_cache_dtype",
        )
    } == {
        "model_path": str(FIXTURE_MODEL),
        "dtype": "bfloat16",
        "tp_size": 2,
        "disable_radix_cache": True,
        "enable_deterministic_inference": True,
        "kv_cache_dtype": "auto",
    }
    assert info["warnings"] == []  # deterministic mode is on: no warning that sampling_seed is ignored
    engine.close()


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


@pytest.mark.parametrize("backend", ["torch_native", "intel_amx"])
def test_deterministic_mode_on_a_cpu_backend_names_the_setting_to_change(sglang, backend):
    """SGLang's own settings check refuses it; the probe says which engine-arg to change."""
    with pytest.raises(ProbeError) as info:
        offline(attention_backend=backend)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"SGLang Engine did not start: Currently only {BACKENDS} attention backends are supported for deterministic "
        f"inference, but you explicitly specified '{backend}'. Set --engine-arg enable_deterministic_inference=false "
        "(SGLang then ignores sampling_seed) or --engine-arg attention_backend to one it names"
    )


def test_cli_engine_that_does_not_start_prints_one_line(sglang, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--engine",
            "sglang-offline",
            "--model",
            str(FIXTURE_MODEL),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--dtype",
            "fp32",
            "--engine-arg",
            "attention_backend=torch_native",
        ],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: SGLang Engine did not start: Currently only")
    assert "--engine-arg enable_deterministic_inference=false" in line
    assert not out.exists()


def test_setting_this_sglang_lacks_and_other_start_failures():
    with pytest.raises(TypeError) as lacking:  # the TypeError SGLang's own ServerArgs raises
        ServerArgs(model_path=str(FIXTURE_MODEL), enable_return_routed_experts_v2=True)
    error = start_failure(lacking.value, "0.5.23")
    assert error.exit_code == 2 and str(error) == (
        "SGLang Engine did not start: SGLang 0.5.23 has no setting 'enable_return_routed_experts_v2'; the probe "
        "needs sglang>=0.5.7: pip install 'mismatch-probe[sglang]'"
    )
    other = start_failure(RuntimeError("Init torch distributed failed.\nCUDA error: no kernel image"), "0.5.23")
    assert type(other) is EngineFailure and other.exit_code == 1
    assert str(other) == (
        "SGLang Engine did not start: RuntimeError: CUDA error: no kernel image (--debug shows the traceback)"
    )


def test_missing_sglang_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ProbeError) as info:
        offline()
    assert info.value.exit_code == 2
    assert str(info.value) == NOT_INSTALLED


def test_dtype_it_cannot_run_is_refused(sglang):
    with pytest.raises(ProbeError, match=r"--dtype fp32-bf16w: --engine sglang-offline runs bf16, fp16, fp32"):
        offline(dtype="fp32-bf16w")


def test_help_engine_lists_the_options_and_cpu_settings():
    text = engine_help("inference", "sglang-offline")
    for key in (
        "tp_size",
        "dp_size",
        "ep_size",
        "mem_fraction_static",
        "attention_backend",
        "disable_radix_cache",
        "enable_deterministic_inference",
        "random_seed",
        "log_level",
    ):
        assert f"\n  {key} " in text
    assert text.splitlines()[-1] == (
        "Settings known to work on CPU (SGLang's CPU build): --engine-arg attention_backend=torch_native "
        "--engine-arg enable_deterministic_inference=false"
    )


def test_cli_without_sglang_exits_2_before_any_output(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", None)
    out = tmp_path / "run"
    args = [
        "generate",
        "--engine",
        "sglang-offline",
        "--model",
        str(FIXTURE_MODEL),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"error: {NOT_INSTALLED}" in result.output
    assert not out.exists()
