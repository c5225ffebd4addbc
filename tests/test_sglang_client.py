"""The `sglang` inference engine against real SGLang 0.5.23 answers (tests/fixtures/sglang-0.5.23).

Parsing is checked on the recorded JSON; the HTTP plumbing on a local server that replays the
recorded SGLang output (tests/fake_servers.py); the numbers themselves by rescoring the same
token ids with the transformers model that produced them.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, free_port, load_fixture, sglang_routes

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.serving.records import sequence_record
from mismatch_probe.engines.serving.server_engine import sampling_seed
from mismatch_probe.engines.sglang.fields import parse_output
from mismatch_probe.engines.sglang.server import SGLangInferenceEngine
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

MODEL = load_model_info(FIXTURE_MODEL)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)


def fixture_record(name: str, routing_start: int = 0):
    out = parse_output(load_fixture(name), MODEL.num_hidden_layers, MODEL.top_k, routing_start)
    return sequence_record(PromptRequest(7, 3, FIXTURE_PROMPT), out, MODEL, name)


def raw_routing(name: str) -> np.ndarray:
    payload = load_fixture(name)["meta_info"]["routed_experts"]
    return np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(-1, 2, 2)


# ---- parsing -----------------------------------------------------------------------------------


def test_greedy_answer_becomes_prompt_plus_response_rows():
    rec = fixture_record("resp_greedy")
    assert rec.sample_id == 7 and rec.prompt_id == 3 and rec.prompt_len == 20
    assert rec.token_ids.tolist() == FIXTURE_PROMPT + [56, 183, 54, 59, 54]
    assert rec.logprob_valid.tolist() == [False] * 20 + [True] * 5
    np.testing.assert_allclose(
        rec.logprob[20:],
        [-0.7390606999397278, -0.9434715509414673, -0.3258245885372162, -1.3093401193618774, -0.2148865908384323],
        rtol=0,
        atol=1e-7,
    )
    assert rec.top_token_id is None  # top_logprobs_num was not requested
    # 24 rows = 20 + 5 - 1: every position but the last sampled token, which was never forwarded.
    assert rec.experts.shape == (25, 2, 2) and rec.experts.dtype == np.uint8
    assert rec.experts_valid.tolist() == [True] * 24 + [False]
    np.testing.assert_array_equal(rec.experts[:24], raw_routing("resp_greedy"))
    assert rec.experts[0].tolist() == [[5, 3], [0, 1]]  # first ids of the base64 payload, by hand


def test_routed_experts_start_len_shifts_rows():
    rec = fixture_record("resp_temp", routing_start=15)
    rows = raw_routing("resp_temp")
    assert rows.shape == (9, 2, 2)  # 20 + 5 - 1 - 15
    assert rec.experts_valid.tolist() == [False] * 15 + [True] * 9 + [False]
    np.testing.assert_array_equal(rec.experts[15:24], rows)
    # Same prompt, same model, so positions 15..19 (prompt-only context) route as in the greedy answer.
    np.testing.assert_array_equal(rec.experts[15:20], raw_routing("resp_greedy")[15:20])


def test_top1_and_temperature_answer():
    rec = fixture_record("resp_temp", routing_start=15)
    assert rec.token_ids[20:].tolist() == [146, 170, 112, 208, 245]
    np.testing.assert_allclose(rec.logprob[20], -2.2488832473754883, atol=1e-7)
    assert rec.top_token_id[20:].tolist() == [56, 170, 60, 208, 245]
    np.testing.assert_allclose(rec.top_logprob[20:22], [-0.31444260478019714, -0.2230195701122284], atol=1e-7)


def test_text_answer_without_routing_has_null_experts():
    out = parse_output(load_fixture("resp_text_noexperts"), 2, 2)
    assert out.routing is None and out.response_ids.tolist() == [291, 34, 152]
    rec = sequence_record(PromptRequest(0, 0, [104, 101, 108, 108, 111]), out, MODEL, "x")
    assert rec.experts is None and rec.logprob_valid.sum() == 3


def test_wrong_row_count_is_refused():
    out = parse_output(load_fixture("resp_greedy"), 2, 2)
    with pytest.raises(EngineFailure, match=r"cover 24 positions from 0, expected 23"):
        sequence_record(PromptRequest(0, 0, FIXTURE_PROMPT[1:]), out, MODEL, "x")


def test_layer_count_that_does_not_divide_is_refused():
    with pytest.raises(EngineFailure, match=r"not a multiple of num_hidden_layers x top_k = 5 x 2"):
        parse_output(load_fixture("resp_greedy"), 5, 2)  # 96 ids


def test_seeds_differ_per_sample_and_repeat():
    params = SamplingParams(seed=5)
    seeds = [sampling_seed(params, s) for s in range(4)]
    assert len(set(seeds)) == 4 and seeds == [sampling_seed(params, s) for s in range(4)]
    assert sampling_seed(SamplingParams(seed=6), 0) != seeds[0]


# ---- HTTP plumbing (a local replay of recorded SGLang output) ---------------------------------


def engine(url: str, **args) -> SGLangInferenceEngine:
    args = {"server_url": url, "timeout_s": 5.0, "max_retries": 2, "retry_backoff_s": 0.01, **args}
    return SGLangInferenceEngine(MODEL, EngineConfig(engine_args=args))


def test_generate_sends_ids_and_explicit_sampling_and_parses_replay():
    with ReplayServer(sglang_routes()) as server:
        eng = engine(server.url)
        eng.check_ready(GREEDY)
        [rec] = eng.generate([PromptRequest(7, 3, FIXTURE_PROMPT)], GREEDY)
        body = server.calls_to("/generate")[-1]
    assert body["input_ids"] == FIXTURE_PROMPT and "text" not in body
    assert body["sampling_params"] == {
        "max_new_tokens": 5,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "sampling_seed": sampling_seed(GREEDY, 7),
    }
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 1
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    expected = fixture_record("resp_greedy")
    np.testing.assert_array_equal(rec.token_ids, expected.token_ids)
    np.testing.assert_array_equal(rec.logprob, expected.logprob)
    np.testing.assert_array_equal(rec.experts, expected.experts)
    assert rec.top_token_id[20:].tolist() == [56, 183, 54, 59, 54]
    info = eng.describe()
    assert info["engine"] == "sglang" and info["server_version"] == "0.5.23" and info["server_url"] == server.url
    assert info["server_args"]["enable_return_routed_experts"] is True and info["warnings"] == []


def test_concurrency_is_bounded_and_order_kept():
    requests = [PromptRequest(i, i, [1 + i, 2, 3]) for i in range(9)]
    with ReplayServer(sglang_routes(), delay_s=0.1) as server:
        records = engine(server.url, concurrency=3).generate(
            requests, SamplingParams(temperature=0.0, max_new_tokens=2)
        )
    assert server.max_in_flight == 3
    assert [r.sample_id for r in records] == list(range(9))
    assert [r.token_ids[0] for r in records] == [1 + i for i in range(9)]
    assert all(len(r) == 5 and r.experts_valid.sum() == 4 for r in records)


def test_503_twice_then_ok_is_retried():
    with ReplayServer(sglang_routes(), fail_first=2) as server:
        [rec] = engine(server.url, max_retries=2).generate([PromptRequest(0, 0, FIXTURE_PROMPT)], GREEDY)
    assert len(server.calls_to("/generate")) == 3 and len(rec) == 25


def test_503_after_last_retry_is_an_engine_failure():
    with ReplayServer(sglang_routes(), fail_first=5) as server:
        with pytest.raises(EngineFailure) as info:
            engine(server.url, max_retries=1).generate([PromptRequest(0, 0, FIXTURE_PROMPT)], GREEDY)
    assert info.value.exit_code == 1
    assert str(info.value) == (
        f'SGLang server at {server.url}: POST /generate failed after 2 attempts (HTTP 503: {{"error": "overloaded"}})'
    )


def test_timeout_is_retried_then_fails():
    with ReplayServer(sglang_routes(), delay_s=1.0) as server:
        with pytest.raises(
            EngineFailure, match=r"stopped answering during generation: .*no answer within 0.2 s after 2 attempts"
        ):
            engine(server.url, timeout_s=0.2, max_retries=1).generate([PromptRequest(0, 0, FIXTURE_PROMPT)], GREEDY)
    assert len(server.calls_to("/generate")) == 2


def test_server_down_names_the_launch_command_with_the_url_host_and_port():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ProbeError) as info:
        engine(url).check_ready(GREEDY)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"cannot reach SGLang server at {url}: start it with `python -m sglang.launch_server --model-path "
        f"{MODEL.path} --disable-radix-cache --enable-return-routed-experts --host 127.0.0.1 --port {port}`"
    )


def test_launch_command_takes_host_and_port_from_the_url():
    eng = engine("http://gpu-host:31000/")
    assert eng.launch_command.endswith("--enable-return-routed-experts --host gpu-host --port 31000")
    assert engine("http://gpu-host").launch_command.endswith("--host gpu-host --port 80")


def test_server_that_never_answers_the_readiness_check_is_a_timeout_not_unreachable():
    with ReplayServer(sglang_routes(), delay_s=1.0) as server:
        with pytest.raises(ProbeError) as info:
            engine(server.url, ready_timeout_s=0.2).check_ready(GREEDY)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"SGLang server at {server.url} accepted the connection but GET {server.url}/get_model_info got no answer "
        "within 0.2 s (2 attempts): it is still starting or is stuck; check its log, or wait longer with "
        "--engine-arg ready_timeout_s=SECONDS"
    )


def test_wrong_model_names_both():
    with ReplayServer(sglang_routes(model_path="/models/Qwen3-30B-A3B")) as server:
        with pytest.raises(ProbeError) as info:
            engine(server.url).check_ready(GREEDY)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"SGLang server at {server.url} serves '/models/Qwen3-30B-A3B', but --model is '{MODEL.path}': "
        "start the server on the same checkpoint"
    )


def test_same_model_under_another_directory_is_accepted():
    with ReplayServer(sglang_routes(model_path="/mnt/ckpt/model")) as server:
        engine(server.url).check_ready(GREEDY)


@pytest.mark.parametrize("server_info", [True, False])
def test_missing_routed_experts_names_the_flag(server_info):
    routes = sglang_routes(routing=False)
    if not server_info:  # an older server without /get_server_info: found out by the probe request
        del routes["/get_server_info"]
    with ReplayServer(routes) as server:
        with pytest.raises(ProbeError) as info:
            engine(server.url).check_ready(GREEDY)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"SGLang server at {server.url} does not return routed experts for this MoE model: "
        "restart it with `--enable-return-routed-experts` (SGLang >= 0.5.7)"
    )


def test_radix_cache_and_eplb_warn():
    args = {"disable_radix_cache": False, "ep_num_redundant_experts": 8}
    with ReplayServer(sglang_routes(server_args=args)) as server:
        eng = engine(server.url)
        eng.check_ready(GREEDY)
    warnings = eng.describe()["warnings"]
    assert len(warnings) == 2
    assert "--disable-radix-cache" in warnings[0] and "--ep-num-redundant-experts 0" in warnings[1]


def test_server_without_deterministic_inference_warns_that_seeds_are_ignored():
    with ReplayServer(sglang_routes(server_args={"enable_deterministic_inference": False})) as server:
        eng = engine(server.url)
        eng.check_ready(GREEDY)
    assert eng.describe()["warnings"] == [
        f"SGLang server at {server.url} does not report --enable-deterministic-inference: it ignores "
        "sampling_seed, so the same --seed gives other samples on a rerun or a --resume"
    ]


@pytest.mark.parametrize(
    "reported, recorded", [("float32", "fp32"), ("bfloat16", "bf16"), ("auto", "unknown"), (None, "unknown")]
)
def test_dtype_is_what_the_server_reports(reported, recorded):
    routes = sglang_routes(server_args={"dtype": reported})
    if reported is None:
        del routes["/get_server_info"]
    with ReplayServer(routes) as server:
        eng = engine(server.url)
        assert eng.dtype == "unknown"  # nothing asked yet
        eng.check_ready(GREEDY)
    assert eng.dtype == eng.describe()["dtype"] == recorded


def test_not_an_sglang_server():
    with ReplayServer({}) as server:
        with pytest.raises(
            ProbeError, match=r"does not look like an SGLang server \(no /get_model_info or /model_info\)"
        ):
            engine(server.url).check_ready(GREEDY)


def test_missing_server_url():
    with pytest.raises(ProbeError) as info:
        SGLangInferenceEngine(MODEL, EngineConfig())
    assert str(info.value) == (
        "--engine-arg server_url: required with --engine sglang (e.g. server_url=http://127.0.0.1:30000; "
        "alias --server-url)"
    )


# ---- the numbers: a transformers float32 rescore of the same token ids -------------------------


@pytest.fixture(scope="module")
def hf_scorer():
    torch = pytest.importorskip("torch")
    from mismatch_probe.engines.hf.training import HFTrainingEngine

    torch.manual_seed(0)
    return HFTrainingEngine(MODEL, EngineConfig(dtype="fp32"))


@pytest.mark.parametrize("name, start, temperature", [("resp_greedy", 0, 1.0), ("resp_temp", 15, 0.7)])
def test_hf_rescore_reproduces_sglang(hf_scorer, name, start, temperature):
    from mismatch_probe.engines.base import ScoreOptions
    from mismatch_probe.rundir.records import ScoreRequest

    rec = fixture_record(name, start)
    request = ScoreRequest(rec.sample_id, rec.prompt_id, rec.token_ids, rec.prompt_len)
    [scored] = hf_scorer.score([request], ScoreOptions(temperature=temperature))
    response = rec.logprob_valid
    assert np.abs(scored.logprob[response] - rec.logprob[response]).max() <= 1e-4
    both = rec.experts_valid & scored.experts_valid
    assert both.sum() == (24 if start == 0 else 9)
    np.testing.assert_array_equal(scored.experts[both], rec.experts[both])  # ids and their order
    if rec.top_token_id is not None:
        np.testing.assert_array_equal(scored.top_token_id[response], rec.top_token_id[response])


# ---- through the command line ------------------------------------------------------------------


def test_probe_generate_writes_the_replayed_rollout(tmp_path):
    import json

    import polars as pl
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": FIXTURE_PROMPT}) + "\n")
    run = tmp_path / "run"
    with ReplayServer(sglang_routes()) as server:
        result = CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                str(FIXTURE_MODEL),
                "--prompts",
                str(prompts),
                "--out",
                str(run),
                "--engine",
                "sglang",
                "--server-url",
                server.url,
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ],
        )
    assert result.exit_code == 0, result.output
    table = pl.read_parquet(run / "rollout").sort("position")
    expected = fixture_record("resp_greedy")
    assert table["token_id"].to_list() == expected.token_ids.tolist()
    assert table["logprob"].to_list()[:20] == [None] * 20
    np.testing.assert_allclose(table["logprob"].to_numpy()[20:], expected.logprob[20:], atol=1e-7)
    experts = table["experts"].to_list()
    assert experts[24] is None and experts[0] == [5, 3, 0, 1]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["engine"]["engine"] == "sglang" and manifest["engine"]["server_version"] == "0.5.23"
    assert manifest["eos_token_ids"] == [256]  # the checkpoint's end ids, which the server stops at


def test_probe_generate_server_down_exits_2_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(FIXTURE_MODEL),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "run"),
            "--engine",
            "sglang",
            "--server-url",
            url,
        ],
    )
    assert result.exit_code == 2
    assert f"cannot reach SGLang server at {url}: start it with `python -m sglang.launch_server" in result.output
    assert "Traceback" not in result.output


def test_probe_generate_records_server_dtype_and_running_cached_tokens(tmp_path):
    import json

    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": FIXTURE_PROMPT[: 4 + i]}) + "\n" for i in range(5)))
    run = tmp_path / "run"
    with ReplayServer(sglang_routes(cached_tokens=3)) as server:
        result = CliRunner().invoke(
            app,
            [
                "generate",
                "--model",
                str(FIXTURE_MODEL),
                "--prompts",
                str(prompts),
                "--out",
                str(run),
                "--engine",
                "sglang",
                "--engine-arg",
                f"server_url={server.url}",
                "--engine-arg",
                "concurrency=1",
                "--max-new-tokens",
                "2",
                "--temperature",
                "0",
                "--dtype",
                "bf16",
            ],
        )
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["dtype"] == manifest["engine"]["dtype"] == "fp32"  # the server's float32, not --dtype
    assert manifest["engine"]["cached_tokens"] == 5 * 3  # five samples in two windows; the readiness probe not counted
