"""The rollout manifest's `quantization` entry of the SGLang and vLLM engines: what the server or the in-process
engine reports of its weight scheme and KV-cache dtype ({weight, act, kv, quantized_modules, skipped_modules},
the unknowns null), or for a vLLM server that does not say, what `--engine-arg` declares.

SGLang: /get_server_info is SGLang's own `ServerArgs(...).resolved_dict()` (what its build_server_info serves,
sglang/srt/utils/common.py), on the replaying server of tests/fake_servers.py; sglang-offline reads the real
ServerArgs the stand-in Engine builds. vLLM: /server_info in its JSON and text forms (vLLM's VllmConfig
serialised, and its __str__: `quantization=fp8, ... kv_cache_dtype=fp8_e4m3, ...`)."""

from __future__ import annotations

import json
import signal

import pytest
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes
from test_vllm_client import PARAMS, vllm_routes
from test_vllm_client import engine as vllm_engine
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.cli_args import engine_help
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info

pytest.importorskip("sglang", reason="SGLang is not installed (the Makefile installs it; the lowest CI lane does not)")
msgspec = pytest.importorskip("msgspec")  # SGLang's settings module needs it; installed beside SGLang

from sglang.srt.server_args import ServerArgs  # noqa: E402

MODEL = load_model_info(FIXTURE_MODEL)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)
FP8 = {"weight": "fp8", "act": None, "kv": "fp8_e4m3", "quantized_modules": None, "skipped_modules": None}


def server_info(**settings) -> dict:
    """SGLang's /get_server_info body for a server started with these settings: its resolved ServerArgs."""
    args = ServerArgs(model_path=str(FIXTURE_MODEL), dtype="float32", enable_return_routed_experts=True,
                      disable_radix_cache=True, enable_deterministic_inference=True, **settings)  # fmt: skip
    return msgspec.to_builtins(args.resolved_dict()) | {"version": "0.5.23"}


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, FP8),
        ({"quantization": "fp8"}, FP8 | {"kv": None}),  # kv_cache_dtype auto: the model's dtype
        ({"kv_cache_dtype": "fp8_e4m3"}, FP8 | {"weight": None}),
        ({}, None),
    ],
)
def test_sglang_server_records_its_quantization_and_kv_cache_dtype(settings, expected):
    info = server_info(**settings)
    assert info["kv_cache_dtype"] == settings.get("kv_cache_dtype", "auto")
    with ReplayServer(sglang_routes(server_args=info)) as server:
        engine = inference_engine("sglang", MODEL, EngineConfig(engine_args={"server_url": server.url}))
        engine.check_ready(GREEDY)
    assert engine.quantization() == expected


def test_probe_generate_writes_the_servers_quantization(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": FIXTURE_PROMPT}) + "\n")
    info = server_info(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    with ReplayServer(sglang_routes(server_args=info)) as server:
        result = CliRunner().invoke(
            app,
            ["generate", "--model", str(FIXTURE_MODEL), "--prompts", str(prompts), "--out", str(tmp_path / "run"),
             "--engine", "sglang", "--server-url", server.url, "--max-new-tokens", "5", "--temperature", "0"],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["quantization"] == FP8
    assert manifest["engine"]["server_args"]["quantization"] == "fp8"


def test_sglang_offline_records_what_its_server_args_resolved(monkeypatch):
    import fake_sglang

    before = signal.getsignal(signal.SIGQUIT)  # the stand-in sets SGLang's handler, as SGLang does: put back
    fake_sglang.install(monkeypatch.setattr)
    try:
        _records_what_its_server_args_resolved()
    finally:
        signal.signal(signal.SIGQUIT, before)


def _records_what_its_server_args_resolved():
    args = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    engine = inference_engine("sglang-offline", MODEL, EngineConfig(dtype="fp32", engine_args=args))
    assert type(engine.engine.server_args) is ServerArgs
    assert engine.engine.kwargs["quantization"] == "fp8" and engine.engine.kwargs["kv_cache_dtype"] == "fp8_e4m3"
    assert engine.quantization() == FP8
    engine.close()
    plain = inference_engine("sglang-offline", MODEL, EngineConfig(dtype="fp32"))
    assert "quantization" not in plain.engine.kwargs and plain.quantization() is None  # kv_cache_dtype auto
    plain.close()


@pytest.mark.parametrize(
    "reported, declared, expected",
    [
        # config_format=json: vLLM's model_config.quantization and cache_config.cache_dtype
        (
            {
                "vllm_config": {
                    "model_config": {"dtype": "torch.bfloat16", "quantization": "fp8"},
                    "cache_config": {"cache_dtype": "fp8_e4m3"},
                }
            },
            {},
            FP8,
        ),  # fmt: skip
        ({"vllm_config": {"model_config": {"quantization": None}, "cache_config": {"cache_dtype": "auto"}}}, {}, None),
        # the text form, VllmConfig.__str__
        (
            {
                "vllm_config": "model='/m', dtype=torch.bfloat16, quantization=fp8, enforce_eager=False, "
                "kv_cache_dtype=auto, device_config=cpu"
            },
            {},
            FP8 | {"kv": None},
        ),  # fmt: skip
        ({"vllm_config": "model='/m', quantization=None, kv_cache_dtype=fp8_e4m3, seed=0"}, {}, FP8 | {"weight": None}),
        # no /server_info (VLLM_SERVER_DEV_MODE unset): as declared, else not quantized
        (None, {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, FP8),
        (None, {"kv_cache_dtype": "auto"}, None),
        (None, {}, None),
        # a server that reports one setting: the other as declared
        ({"vllm_config": {"model_config": {"quantization": "fp8"}}}, {"kv_cache_dtype": "fp8_e4m3"}, FP8),
    ],
)
def test_vllm_server_records_what_it_reports_else_what_is_declared(reported, declared, expected):
    routes = vllm_routes()
    if reported is not None:
        routes["/server_info?config_format=json"] = lambda body, s: (200, reported)
    with ReplayServer(routes) as server:
        engine = vllm_engine(server.url, **declared)
        engine.check_ready(PARAMS)
    assert engine.quantization() == expected


def test_vllm_declared_setting_the_server_contradicts_is_refused():
    routes = vllm_routes()
    reported = {"vllm_config": {"model_config": {"quantization": None}, "cache_config": {"cache_dtype": "auto"}}}
    routes["/server_info?config_format=json"] = lambda body, s: (200, reported)
    with ReplayServer(routes) as server:
        engine = vllm_engine(server.url, quantization="fp8")
        with pytest.raises(ProbeError) as refused:
            engine.check_ready(PARAMS)
    assert str(refused.value) == (
        f"--engine-arg quantization=fp8: the vLLM server at {server.url} reports quantization None; drop the "
        "option (the server's own setting is recorded)"
    )


@pytest.mark.parametrize("name", ["vllm", "vllm-offline", "sglang-offline"])
def test_help_engine_names_the_quantization_options(name):
    text = engine_help("inference", name)
    assert "quantization" in text and "kv_cache_dtype" in text
