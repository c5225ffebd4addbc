"""`probe rescore --engine sglang`: the inference engine's own prefill of the rollout, decode against prefill.

SGLang's real answer shapes (tests/fixtures/sglang-0.5.23, `ServerArgs`) through a prefill stand-in
(prefill_standin.py); a planted decode fault with a known answer (the rollout's decode log-probs carry an error
from position 20 that the engine's prefill does not): the decode share and the onset come out where planted;
a clean rollout (decode and prefill with the same error distribution) has a decode share whose interval holds 0.
The live vLLM case is in test_vllm_live.py."""

from __future__ import annotations

import importlib.machinery
import json
import shlex
import shutil
import signal
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, free_port, load_fixture, sglang_routes
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.serving.prefill import AT_ONE, rescale_from_top
from mismatch_probe.engines.sglang.prefill import parse_prefill, prefill_body
from mismatch_probe.pipeline.diagnose.prefill_pass import prefill_pass
from mismatch_probe.pipeline.diagnose.summary import share_lines

pytest.importorskip("sglang", reason="SGLang is not installed (the Makefile installs it; the lowest CI lane does not)")
pytest.importorskip("msgspec")

from prefill_standin import FixtureModel, engine_error, prefill_routes  # noqa: E402

ONSET, PLANTED = 20, -0.3  # the decode fault: -0.3 nats on every response token from position 20


def probe(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def model():
    return FixtureModel()


def test_sglang_input_logprobs_are_prefill_at_t1(model):
    """The real answer at T = 0.7 with logprob_start_len=0: its input log-probs are the model's log_softmax(logits)
    at T = 1 (SGLang scales them only with temp_scaled_logprobs), so a T != 1 rollout's prefill set needs a rescale."""
    got = parse_prefill(load_fixture("resp_temp"), FIXTURE_PROMPT, 2, 2, "fixture")
    lp = model.logprobs(FIXTURE_PROMPT)
    at_one = lp[np.arange(20), FIXTURE_PROMPT]
    assert np.isnan(got.logprob[0]) and np.abs(got.logprob[1:] - at_one[1:]).max() < 1e-4
    logits = model.logits(FIXTURE_PROMPT)
    scaled = torch.log_softmax(logits / 0.7, -1).numpy()[np.arange(19), FIXTURE_PROMPT[1:]]
    assert np.median(np.abs(got.logprob[1:] - scaled)) > 1e-2
    assert got.top_ids.shape == (20, 2) and (got.top_ids[0] == -1).all()  # top_logprobs_num 2, none at 0
    assert got.cached_tokens == 0 and got.weight_version == "default"
    body = prefill_body(FIXTURE_PROMPT, 0.7, 2, moe=True)
    assert body["logprob_start_len"] == 0 and body["routed_experts_start_len"] == 0 and body["return_logprob"]


@pytest.mark.parametrize("t", [0.7, 1.6])
def test_rescale_from_top_is_exact_over_the_vocabulary_and_bounded_below_it(model, t):
    ids = FIXTURE_PROMPT
    logits = model.logits(ids)
    lp1 = torch.log_softmax(logits, -1).numpy()[:-1]
    truth = torch.log_softmax(logits / t, -1).numpy()[np.arange(19), ids[1:]]
    own = lp1[np.arange(19), ids[1:]]
    order = np.argsort(-lp1, axis=1)
    for top, exact in ((lp1.shape[1], True), (5, False)):
        top_ids = order[:, :top]
        value, bound = rescale_from_top(own, top_ids, np.take_along_axis(lp1, top_ids, 1), np.array(ids[1:]), t, 320)
        if exact:
            assert np.abs(value - truth).max() < 1e-9 and bound.max() == 0
        else:  # the tail left out only lowers the true value, by at most the bound
            assert (value >= truth - 1e-12).all() and (value - truth <= bound + 1e-12).all() and bound.max() > 0


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """An hf float32 rollout of the fixture model at T = 1: 24 samples, 6 prompt tokens, 40 new tokens."""
    tmp = tmp_path_factory.mktemp("prefill")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input_ids": [10 + i, 40 + i, 41, 42, 43, 44 + i]}) + "\n" for i in range(24))
    )
    run = tmp / "run"
    probe("generate", "--model", FIXTURE_MODEL, "--prompts", prompts, "--out", run, "--engine", "hf", "--dtype",
          "fp32", "--max-new-tokens", 40, "--temperature", 1.0, "--seed", 3)  # fmt: skip
    return run


def decoded(rollout, folder, planted: float):
    """The rollout as an engine whose decode path carries its own per-token error and `planted` nats from ONSET."""
    run = folder / "run"
    shutil.copytree(rollout, run)
    for part in sorted((run / "rollout").glob("part-*.parquet")):
        table = pq.read_table(part)
        ids, pos = table.column("token_id").to_numpy(), table.column("position").to_numpy()
        samples = table.column("sample_id").to_numpy()
        lp = table.column("logprob").to_numpy(zero_copy_only=False).astype(np.float64)
        for s in np.unique(samples):
            rows = np.flatnonzero(samples == s)
            lp[rows] += engine_error(ids[rows].tolist(), "decode") + planted * (pos[rows] >= ONSET)
        lp = np.minimum(lp, 0.0)  # a log-probability; the report refuses one above 0
        column = pa.array(lp.astype(np.float32), mask=table.column("logprob").is_null().to_numpy(zero_copy_only=False))
        table = table.set_column(table.schema.get_field_index("logprob"), table.schema.field("logprob"), column)
        pq.write_table(table, part)
    return run


def k3_naive(ref: np.ndarray, cand: np.ndarray) -> float:
    log_r = cand - ref
    return float(np.mean(np.exp(log_r) - 1 - log_r))


def response_logprobs(folder) -> np.ndarray:
    table = pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("part-*.parquet"))])
    table = table.sort_by([("sample_id", "ascending"), ("position", "ascending")])
    keep = table.column("is_response").to_numpy(zero_copy_only=False)
    return table.column("logprob").to_numpy(zero_copy_only=False).astype(np.float64)[keep]


@pytest.mark.parametrize("planted", [PLANTED, 0.0])
def test_decode_share_and_onset_come_out_where_planted(rollout, model, tmp_path, planted):
    run = decoded(rollout, tmp_path, planted)
    with ReplayServer(prefill_routes(model, cached_tokens=4)) as server:
        probe("rescore", run, "--engine", "sglang", "--engine-arg", f"server_url={server.url}")
    probe("rescore", run, "--engine", "hf", "--dtype", "fp32")
    probe("report", run)
    side = json.loads((run / "scores" / "sglang-prefill" / "manifest.json").read_text())
    assert side["kind"] == "engine-prefill" and side["prefill"]["temperature_rule"] == AT_ONE
    assert side["role"] == "engine-prefill"  # a diagnostic set: never the verdict's matched one, not gated by default
    assert side["prefill"]["weight_versions"] == ["default"] and side["prefill"]["cached_tokens"] == 4 * 24
    assert side["engine"]["server_args"]["disable_radix_cache"] is True
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    attribution = metrics["attribution"]
    [gap], [share] = attribution["decode_gap"], attribution["decode_share"]
    [said] = [line for line in share_lines(metrics) if "decode_share" in line]  # diagnose's first screen
    assert said.startswith("the engine's decode path explains") and "rollout vs hf fp32" in said
    ro, pre, hf = (response_logprobs(run / d) for d in ("rollout", "scores/sglang-prefill", "scores/hf-fp32"))
    expected = 1 - k3_naive(pre, hf) / k3_naive(ro, hf)
    assert share["share"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert gap["k3_kl"] == pytest.approx(k3_naive(ro, pre), rel=1e-6)
    low, high = share["share_ci95"]
    doctor = CliRunner().invoke(app, ["doctor", str(run), "--json"], catch_exceptions=False)
    found = {f["check"]: f for f in json.loads(doctor.output)["findings"]}
    page = (run / "report" / "index.html").read_text()
    assert '<section id="decode">' in page  # the figure of mean |delta| by position
    if planted:  # the decode fault is nearly all of the rollout's k3 against training, from position 20 on
        assert gap["onset_position"] == ONSET and low > 0.95
        assert f"decode leaves prefill at {ONSET}" in page and f"decode leaves prefill from position {ONSET}" in page
        path = found["decode_path"]
        assert path["evidence"]["onset_position"] == ONSET and "kv_cache_dtype" in path["found"]
    else:  # decode and prefill carry errors of one distribution: nothing of the gap is the decode path's
        assert gap["onset_position"] is None and low < 0 < high
        assert doctor.exit_code in (0, 1) and "decode_path" not in found


def test_diagnose_plans_engine_prefill_where_the_recorded_server_answers(rollout, model, tmp_path):
    """An SGLang rollout: the pass is planned while its recorded server answers, and its command scores the
    rollout by that server's prefill; once the server is gone, skipped with why and the same command."""
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    manifest = json.loads((run / "manifest.json").read_text())
    with ReplayServer(prefill_routes(model)) as server:
        manifest["engine"] = {"engine": "sglang", "server_url": server.url}
        manifest["engine_options"] = {"server_url": server.url, "concurrency": 2}  # as sglang records them
        (run / "manifest.json").write_text(json.dumps(manifest))
        probe("diagnose", run, "--dry-run")
        [planned] = [p for p in plan_of(run) if p["name"] == "engine-prefill"]
        assert planned["status"] == "planned" and planned["command"] == f"probe rescore {run} --engine sglang"
        probe(*shlex.split(planned["command"])[1:])
    assert json.loads((run / "scores" / "sglang-prefill" / "manifest.json").read_text())["kind"] == "engine-prefill"
    probe("diagnose", run, "--dry-run")
    [skipped] = [p for p in plan_of(run) if p["name"] == "engine-prefill"]
    assert skipped["status"] == "skipped" and skipped["command"] == planned["command"]
    assert skipped["why"].startswith(f"the rollout's sglang server cannot be reached: no answer from {server.url}")
    hf = prefill_pass(run, "hf", None)
    assert hf.status == "skipped" and "not an inference engine" in hf.why


def plan_of(run) -> list[dict]:
    return json.loads((run / "diagnose" / "plan.json").read_text())["passes"]


def test_generate_records_cached_tokens_and_weight_version_per_sample(tmp_path):
    """What SGLang's meta_info says of each sample's path lands on its rows; an hf rollout has no such columns."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": FIXTURE_PROMPT}) + "\n")
    with ReplayServer(sglang_routes(cached_tokens=3)) as server:
        probe("generate", "--model", FIXTURE_MODEL, "--prompts", prompts, "--out", tmp_path / "run", "--engine",
              "sglang", "--server-url", server.url, "--max-new-tokens", 5, "--temperature", 0)  # fmt: skip
    [part] = sorted((tmp_path / "run" / "rollout").glob("part-*.parquet"))
    table = pq.read_table(part)
    assert table.schema.field("cached_tokens").type == pa.uint32() and table.schema.field("cached_tokens").nullable
    assert set(table.column("cached_tokens").to_pylist()) == {3} and table.num_rows == 25
    assert set(table.column("weight_version").to_pylist()) == {"default"}


def with_cache_column(run, hits: set[int]) -> None:
    """The rollout as a serving engine records it: cached_tokens 4 on the samples in `hits`, 0 on the others."""
    for part in sorted((run / "rollout").glob("part-*.parquet")):
        table = pq.read_table(part)
        cached = np.where(np.isin(table.column("sample_id").to_numpy(), list(hits)), 4, 0).astype(np.uint32)
        table = table.append_column(pa.field("cached_tokens", pa.uint32(), nullable=True), pa.array(cached))
        pq.write_table(table, part)


def test_decode_gap_split_by_cache_hit_and_the_doctor_names_a_stale_prefix_cache(rollout, model, tmp_path):
    """A decode fault on the samples the prefix cache served (every third one), along the whole response: the
    report's split puts it on the hits, and the doctor names decode_path by cache hits (no step by position)."""
    run = decoded(rollout, tmp_path, 0.0)
    hits = set(range(0, 24, 3))
    for part in sorted((run / "rollout").glob("part-*.parquet")):  # -0.3 nats on the hits' response tokens
        table = pq.read_table(part)
        hit = np.isin(table.column("sample_id").to_numpy(), list(hits)) & table.column("is_response").to_numpy()
        lp = table.column("logprob").to_numpy(zero_copy_only=False) - np.float32(0.3) * hit
        column = pa.array(lp.astype(np.float32), mask=table.column("logprob").is_null().to_numpy(zero_copy_only=False))
        pq.write_table(table.set_column(table.schema.get_field_index("logprob"), "logprob", column), part)
    with_cache_column(run, hits)
    with ReplayServer(prefill_routes(model)) as server:
        probe("rescore", run, "--engine", "sglang", "--engine-arg", f"server_url={server.url}")
    probe("report", run)
    [gap] = json.loads((run / "report" / "metrics.json").read_text())["attribution"]["decode_gap"]
    split = gap["cache_split"]
    ro, pre = response_logprobs(run / "rollout"), response_logprobs(run / "scores" / "sglang-prefill")
    table = pa.concat_tables([pq.read_table(p) for p in sorted((run / "rollout").glob("part-*.parquet"))])
    on_hit = np.isin(table.column("sample_id").to_numpy(), list(hits))[table.column("is_response").to_numpy()]
    assert split["cache_hit"]["n_samples"] == len(hits) and split["cache_miss"]["n_samples"] == 24 - len(hits)
    assert split["cache_hit"]["k3_kl"] == pytest.approx(k3_naive(ro[on_hit], pre[on_hit]), rel=1e-6)
    assert split["cache_miss"]["k3_kl"] == pytest.approx(k3_naive(ro[~on_hit], pre[~on_hit]), rel=1e-6)
    assert gap["onset_position"] is None
    doctor = CliRunner().invoke(app, ["doctor", str(run), "--json"], catch_exceptions=False)
    found = {f["check"]: f for f in json.loads(doctor.output)["findings"]}
    assert "prefix-cache hits" in found["decode_path"]["found"]
    assert found["decode_path"]["evidence"]["cache"]["cache_hit"]["n_tokens"] == int(on_hit.sum())


def test_bad_prefill_requests_exit_2_naming_the_fix(rollout, tmp_path):
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    url = f"http://127.0.0.1:{free_port()}"
    for args, said in (
        (
            ["--engine-arg", f"server_url={url}"],
            f"cannot reach SGLang server at {url}: start it with `python -m sglang",
        ),
        (["--replay", "r3"], "--replay r3: --engine sglang scores the server's raw prompt log-probs only"),
        (
            ["--sampling", "rollout"],
            "--sampling rollout: --engine sglang scores the server's raw prompt log-probs only",
        ),
        ([], "--engine-arg server_url: required with --engine sglang"),  # an hf rollout records no server
    ):
        result = CliRunner().invoke(app, ["rescore", str(run), "--engine", "sglang", *args])
        assert result.exit_code == 2 and said in result.output, result.output
        assert not (run / "scores").exists() or not any((run / "scores").iterdir())


def standin_vllm(model: FixtureModel) -> types.ModuleType:
    """A `vllm` module whose `LLM` answers as vLLM's does, from a float32 forward of the fixture model: sampled
    log-probs processed (log_softmax(logits / T), the engine's `logprobs_mode`), prompt log-probs at T = 1."""

    def entry(lp: np.ndarray, ids) -> dict:
        return {int(i): types.SimpleNamespace(logprob=float(lp[i])) for i in ids}

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def generate(self, prompts, params, use_tqdm=False):
            params = params if isinstance(params, list) else [params] * len(prompts)
            out = []
            for prompt, p in zip(prompts, params):
                ids = prompt["prompt_token_ids"]
                logits = model.logits(ids)
                last = torch.log_softmax(logits[-1] / max(p.temperature, 1e-6), -1).numpy()
                token = int(np.argmax(last))
                top = np.argsort(-last)[: p.logprobs or 1]
                completion = types.SimpleNamespace(token_ids=[token], logprobs=[entry(last, {token, *top})])
                rows = None
                if p.prompt_logprobs is not None:
                    lp = model.logprobs(ids)
                    rows = [None] + [
                        entry(lp[i], {ids[i], *np.argsort(-lp[i])[: p.prompt_logprobs]}) for i in range(1, len(ids))
                    ]
                out.append(types.SimpleNamespace(outputs=[completion], prompt_logprobs=rows))
            return out

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.__version__ = "stand-in"
    module.LLM = LLM
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(
        **({"logprobs": None, "prompt_logprobs": None} | kwargs)
    )
    return module


def test_vllm_offline_prefill_scores_the_stored_ids_in_process(rollout, model, tmp_path, monkeypatch):
    """`--engine vllm-offline`: the LLM class in this process (a stand-in with vLLM's answer objects) scores the
    rollout by prefill; at T = 1 its prompt log-probs are the fixture model's, as the hf fp32 rescore's."""
    monkeypatch.setitem(sys.modules, "vllm", standin_vllm(model))
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    probe("rescore", run, "--engine", "vllm-offline", "--engine-arg", "enable_prefix_caching=false")
    probe("rescore", run, "--engine", "hf", "--dtype", "fp32")
    side = json.loads((run / "scores" / "vllm-offline-prefill" / "manifest.json").read_text())
    assert side["kind"] == "engine-prefill" and side["prefill"]["temperature_rule"] == AT_ONE
    assert side["prefill"]["server_scales_prompt_logprobs"] is False and side["engine"]["engine"] == "vllm-offline"
    prefill, hf = (
        response_logprobs(run / "scores" / "vllm-offline-prefill"),
        response_logprobs(run / "scores" / "hf-fp32"),
    )
    assert len(prefill) == len(hf) > 0 and np.abs(prefill - hf).max() < 1e-5
    planned = prefill_pass(run, "vllm-offline", None)  # diagnose: an in-process engine is reached if it imports
    assert planned.status == "planned" and planned.command == f"probe rescore {run} --engine vllm-offline"
    monkeypatch.delitem(sys.modules, "vllm")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # vllm not installed
    skipped = prefill_pass(run, "vllm-offline", None)
    assert skipped.status == "skipped" and skipped.why.startswith("vllm-offline does not import here: pip install")


def test_vllm_offline_prefill_loads_at_the_rollouts_dtype(rollout, model, tmp_path, monkeypatch):
    """Without --dtype an in-process prefill loads at the rollout's dtype (a training rescore's default, fp32,
    would score another model than the one that sampled); --dtype still overrides it."""
    module = standin_vllm(model)
    made = []

    class Recording(module.LLM):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(**kwargs)

    module.LLM = Recording
    monkeypatch.setitem(sys.modules, "vllm", module)
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"dtype": "bfloat16"}))
    probe("rescore", run, "--engine", "vllm-offline", "--engine-arg", "enable_prefix_caching=false")
    probe("rescore", run, "--engine", "vllm-offline", "--dtype", "fp32", "--name", "at-fp32")
    assert [kwargs["dtype"] for kwargs in made] == ["bfloat16", "float32"]


def test_sglang_offline_prefill_scores_the_stored_ids_in_process(rollout, model, tmp_path, monkeypatch):
    """`--engine sglang-offline`: SGLang's Engine in this process (a stand-in on the real sglang module, built on
    SGLang's own ServerArgs, answering in the fixture's shape from a float32 forward of the fixture model) scores
    an sglang-offline rollout by prefill, from the Engine options the rollout recorded; its input log-probs are the
    fixture model's, as the hf fp32 rescore's. Diagnose plans it where sglang imports, skips it otherwise."""
    import fake_sglang
    from fake_sglang import StandInEngine

    before = signal.getsignal(signal.SIGQUIT)  # the stand-in sets SGLang's SIGQUIT handler, as the Engine does
    fake_sglang.install(monkeypatch.setattr, routes=prefill_routes(model, sigma=0.0))
    monkeypatch.setattr(StandInEngine, "instances", [])
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["engine"], manifest["dtype"] = {"engine": "sglang-offline"}, "bfloat16"  # the Engine loads at it
    manifest["engine_options"] = {"mem_fraction_static": 0.5, "disable_radix_cache": True}  # as generate records
    (run / "manifest.json").write_text(json.dumps(manifest))
    try:
        planned = prefill_pass(run, "sglang-offline", None)  # diagnose: an in-process engine is reached if it imports
        assert planned.status == "planned" and planned.command == f"probe rescore {run} --engine sglang-offline"
        probe(*shlex.split(planned.command)[1:])
    finally:
        signal.signal(signal.SIGQUIT, before)
    probe("rescore", run, "--engine", "hf", "--dtype", "fp32")
    [engine] = StandInEngine.instances
    assert engine.kwargs["mem_fraction_static"] == 0.5 and engine.kwargs["dtype"] == "bfloat16" and engine.shut
    scoring = [c for c in engine.calls if c["logprob_start_len"] == 0]
    assert len(scoring) == 2 + 24 and all(c["return_logprob"] and c["routed_experts_start_len"] == 0 for c in scoring)
    side = json.loads((run / "scores" / "sglang-offline-prefill" / "manifest.json").read_text())
    assert side["kind"] == side["role"] == "engine-prefill" and side["prefill"]["temperature_rule"] == AT_ONE
    assert side["prefill"]["server_scales_prompt_logprobs"] is False and side["engine"]["engine"] == "sglang-offline"
    assert side["dtype"] == "bf16"  # the Engine's resolved ServerArgs, not the CLI's default
    prefill, hf = (
        response_logprobs(run / "scores" / "sglang-offline-prefill"),
        response_logprobs(run / "scores" / "hf-fp32"),
    )
    assert len(prefill) == len(hf) > 0 and np.abs(prefill - hf).max() < 1e-5
    monkeypatch.setitem(sys.modules, "sglang", None)  # sglang does not import
    skipped = prefill_pass(run, "sglang-offline", None)
    assert skipped.status == "skipped" and skipped.why.startswith(
        "sglang-offline does not import here: pip install 'mismatch-probe[sglang]'"
    )
