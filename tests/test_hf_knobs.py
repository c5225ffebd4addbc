"""The hf engines' knobs (engines/hf/knobs.py): attn_implementation, lm_head_dtype=fp32 and router_dtype=fp32,
each against a direct transformers computation of the same change on the same tokens, recorded in the manifest,
switched in place by `reconfigure` and back bit for bit, and under R3 and R2 replay. Every family's router in fp32:
tests/test_hf_knobs_families.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from moe_families import expert_sets
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines import inference_engine, training_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.hf.training import HFTrainingOptions
from mismatch_probe.engines.options import build_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest
from mismatch_probe.vocab import NO_REPLAY, R2

runner = CliRunner()
PROMPTS = [[5, 9, 17, 33], [7, 40, 2], [60, 3, 50, 64, 12], [11, 12, 13]]
FLASH_MISSING = (
    "error: --engine-arg attn_implementation=flash_attention_2: needs the flash_attn package, which is not "
    "installed (pip install flash-attn)"
)


def probe(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _generate(model: Path, out: Path, *extra) -> Path:
    prompts = out.parent / f"{out.name}-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in PROMPTS))
    result = probe(
        "generate", "--model", model, "--prompts", prompts, "--out", out, "--dtype", "bf16",
        "--temperature", 1.0, "--seed", 1, *(extra or ("--max-new-tokens", 6)),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def _rescore(run: Path, name: str, *extra) -> pl.DataFrame:
    result = probe("rescore", run, "--name", name, *extra)
    assert result.exit_code == 0, result.output
    return pl.read_parquet(run / "scores" / name / "*.parquet").sort("sample_id", "position")


def _engine_facts(side: Path) -> dict:
    return json.loads((side / "manifest.json").read_text())["engine"]


@pytest.fixture(scope="module")
def run(tiny_moe, tmp_path_factory) -> Path:
    """A bf16 hf rollout of the tiny MoE model, generated with the fp32 LM head."""
    return _generate(tiny_moe, tmp_path_factory.mktemp("knobs") / "run", "--engine-arg", "lm_head_dtype=fp32")


def _near_tie_checkpoint(path: Path) -> Path:
    """A Qwen3-MoE whose experts 1 and 2 have router rows one bf16 ulp from expert 0's in 8 entries: their bf16
    logits tie with expert 0's (the bf16 product rounds the difference away) where fp32 still orders them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=96, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
        pad_token_id=1, tie_word_embeddings=False, initializer_range=0.2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight.copy_(weight.to(torch.bfloat16).float())
            for expert, direction in ((1, float("inf")), (2, float("-inf"))):
                row = weight[0].clone().to(torch.bfloat16)
                row[:8] = torch.nextafter(row[:8], torch.full((8,), direction, dtype=torch.bfloat16))
                weight[expert] = row.float()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory) -> Path:
    return _near_tie_checkpoint(tmp_path_factory.mktemp("near-ties"))


def _batch(n: int = 6, length: int = 40, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [ScoreRequest(i, i, rng.integers(2, 96, length - 2 * i), prompt_len=3) for i in range(n)]


def _replayed(batch, records) -> list[ScoreRequest]:
    return [
        ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len, f.experts, np.ones(len(r), bool))
        for r, f in zip(batch, records)
    ]


def _same(a, b) -> bool:
    return all(np.array_equal(x.logprob, y.logprob) and np.array_equal(x.experts, y.experts) for x, y in zip(a, b))


# ---- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("attn_implementation", "paged", "--engine-arg attn_implementation=paged: expected one of none, eager, sdpa, "
         "flex_attention, flash_attention_2"),
        ("lm_head_dtype", "bf16", "--engine-arg lm_head_dtype=bf16: expected one of none, fp32"),
        ("router_dtype", "fp64", "--engine-arg router_dtype=fp64: expected one of none, fp32"),
    ],
)  # fmt: skip
def test_bad_knob_values_are_refused(key, value, message):
    with pytest.raises(ProbeError) as caught:
        build_options(HFTrainingOptions, "hf", {key: value})
    assert str(caught.value) == message


@pytest.fixture
def no_flash_attn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))


def test_flash_attention_missing_exits_2_before_any_folder(run, tiny_moe, no_flash_attn, tmp_path):
    out = tmp_path / "never"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6]}) + "\n")
    flag = ("--engine-arg", "attn_implementation=flash_attention_2")
    generate = ["generate", "--model", str(tiny_moe), "--prompts", str(prompts), "--out", str(out), *flag]
    generated = runner.invoke(app, generate)
    assert generated.exit_code == 2 and generated.output.strip() == FLASH_MISSING
    assert not out.exists()
    before = sorted(p.name for p in (run / "scores").iterdir()) if (run / "scores").exists() else []
    rescored = runner.invoke(app, ["rescore", str(run), "--name", "flash", *flag])
    assert rescored.exit_code == 2 and rescored.output.strip() == FLASH_MISSING
    assert (sorted(p.name for p in (run / "scores").iterdir()) if (run / "scores").exists() else []) == before


def test_flash_attention_is_accepted_where_installed(monkeypatch):
    real = importlib.util.find_spec
    fake = lambda name, *a: real("torch") if name == "flash_attn" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)
    options = build_options(HFTrainingOptions, "hf", {"attn_implementation": "flash_attention_2"})
    assert options.attn_implementation == "flash_attention_2"


# ---- lm_head_dtype=fp32 -----------------------------------------------------------------------------------------
def test_fp32_lm_head_rescore_equals_the_fp32_product_of_the_final_hidden_states(run, tiny_moe):
    """`probe rescore --engine-arg lm_head_dtype=fp32` at bf16 against transformers directly: the model's bf16
    final hidden states (model.model(...)), upcast, times the fp32 head weight, log_softmax at the targets."""
    from transformers import AutoModelForCausalLM

    frame = _rescore(run, "head32", "--dtype", "bf16", "--batch-size", 1, "--engine-arg", "lm_head_dtype=fp32")
    assert _engine_facts(run / "scores" / "head32")["lm_head_dtype"] == "fp32"
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.bfloat16).eval()
    head = model.lm_head.weight.detach()
    largest_bf16_gap = 0.0
    for sample in frame["sample_id"].unique().to_list():
        rows = frame.filter(pl.col("sample_id") == sample)
        ids = torch.tensor(rows["token_id"].to_list()).view(1, -1)
        with torch.no_grad():
            hidden = model.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None]
            ).last_hidden_state[0]
        assert hidden.dtype == torch.bfloat16
        scored = rows["logprob"].is_not_null().to_numpy()
        positions = np.flatnonzero(scored)
        targets = ids[0, positions]
        fp32 = torch.log_softmax(hidden.float() @ head.float().T, -1)[positions - 1, targets].numpy()
        bf16 = torch.log_softmax((hidden @ head.T).float(), -1)[positions - 1, targets].numpy()
        got = rows["logprob"].to_numpy()[scored]
        np.testing.assert_allclose(got, fp32, rtol=0, atol=2e-6)
        largest_bf16_gap = max(largest_bf16_gap, float(np.abs(got - bf16).max()))
    assert largest_bf16_gap > 1e-3  # the bf16 head is a different answer: the test tells them apart


def test_generate_applies_the_fp32_lm_head_inside_generate(run, tiny_moe):
    assert _engine_facts(run)["lm_head_dtype"] == "fp32"  # the fixture's rollout, from the CLI
    engine = inference_engine(
        "hf", load_model_info(tiny_moe), EngineConfig(dtype="bf16", engine_args={"lm_head_dtype": "fp32"})
    )
    # the head's fp32 weights exist only while it runs: the model holds its bf16 weights between calls
    assert engine.hf.lm_head.weight.dtype == torch.bfloat16 and engine.describe()["lm_head_dtype"] == "fp32"
    weight = engine.hf.lm_head.weight.detach().float()
    norms = []  # the final norm's output of every forward generate runs
    engine.hf.model.norm.register_forward_hook(lambda _m, _i, out: norms.append(out[:, -1].detach().clone()))
    [record] = engine.generate([PromptRequest(0, 0, PROMPTS[2])], SamplingParams(temperature=0, max_new_tokens=6))
    response = record.token_ids[record.prompt_len :]
    assert len(norms) >= len(response) and norms[0].dtype == torch.bfloat16
    hidden = torch.cat(norms[: len(response)])
    fp32 = torch.log_softmax(hidden.float() @ weight.T, -1)[torch.arange(len(response)), torch.tensor(response)]
    bf16 = torch.log_softmax((hidden @ weight.to(torch.bfloat16).T).float(), -1)
    bf16 = bf16[torch.arange(len(response)), torch.tensor(response)]
    np.testing.assert_allclose(record.logprob[record.prompt_len :], fp32.numpy(), rtol=0, atol=2e-6)
    assert np.abs(record.logprob[record.prompt_len :] - bf16.numpy()).max() > 1e-4


# ---- attn_implementation ---------------------------------------------------------------------------------------
def test_eager_attention_is_recorded_and_matches_sdpa_at_fp32(run):
    sdpa = _rescore(run, "sdpa32", "--dtype", "fp32")
    eager = _rescore(run, "eager32", "--dtype", "fp32", "--engine-arg", "attn_implementation=eager")
    assert _engine_facts(run / "scores" / "sdpa32")["attn_implementation"] == "sdpa"  # transformers' default
    assert _engine_facts(run / "scores" / "eager32")["attn_implementation"] == "eager"
    assert _engine_facts(run)["attn_implementation"] == "sdpa"
    scored = sdpa["logprob"].is_not_null()
    assert scored.sum() > 10 and scored.equals(eager["logprob"].is_not_null())
    np.testing.assert_allclose(eager["logprob"].drop_nulls(), sdpa["logprob"].drop_nulls(), rtol=0, atol=1e-5)


# ---- reconfigure -----------------------------------------------------------------------------------------------
def test_reconfigure_switches_knobs_in_place_and_back_bitwise(tiny_moe):
    info = load_model_info(tiny_moe)
    engine = training_engine("hf", info, EngineConfig(dtype="bf16"))
    batch, options = _batch(3, 20), ScoreOptions(temperature=1.0)
    fresh = training_engine("hf", info, EngineConfig(dtype="bf16")).score(batch, options)
    head = engine.hf.lm_head.weight
    assert engine.reconfigure({"lm_head_dtype": "fp32", "logprob_chunk": 7})
    assert engine.describe()["lm_head_dtype"] == "fp32" and engine.hf.lm_head.weight is head  # no fp32 copy held
    switched = engine.score(batch, options)
    assert not _same(switched, fresh)
    assert engine.reconfigure({})
    assert engine.hf.lm_head.weight is head and engine.describe()["lm_head_dtype"] == "bf16"
    assert _same(engine.score(batch, options), fresh)  # bitwise the fresh engine's
    assert engine.reconfigure({"router_dtype": "fp32", "attn_implementation": "eager"})
    assert (engine.describe()["router_dtype"], engine.describe()["attn_implementation"]) == ("fp32", "eager")
    assert engine.reconfigure({"logprob_chunk": 256})
    assert _same(engine.score(batch, options), fresh)
    described = engine.describe()
    for needs_a_load in (
        {"weight_quant": "fp8-tensor"},
        {"kv_quant": "fp8", "lm_head_dtype": "fp32"},
        {"device": "cpu"},
    ):
        assert engine.reconfigure(needs_a_load) is False
        assert engine.describe() == described and engine.options == build_options(HFTrainingOptions, "hf", {})
    assert _same(engine.score(batch, options), fresh)


def test_an_engine_built_with_knobs_switches_back_to_the_plain_model(tiny_moe):
    info = load_model_info(tiny_moe)
    knobs = {"lm_head_dtype": "fp32", "router_dtype": "fp32", "attn_implementation": "eager"}
    engine = training_engine("hf", info, EngineConfig(dtype="bf16", engine_args=knobs))
    assert [engine.describe()[key] for key in knobs] == ["fp32", "fp32", "eager"]
    batch, options = _batch(3, 20, seed=1), ScoreOptions(temperature=1.0)
    assert engine.reconfigure({})
    assert _same(
        engine.score(batch, options), training_engine("hf", info, EngineConfig(dtype="bf16")).score(batch, options)
    )


def test_knobs_with_kv_quant_keep_the_kv_rounding(tiny_moe):
    info = load_model_info(tiny_moe)
    batch, options = _batch(2, 16, seed=2), ScoreOptions(temperature=1.0)
    eager_kv = EngineConfig(dtype="bf16", engine_args={"kv_quant": "fp8", "attn_implementation": "eager"})
    expected = training_engine("hf", info, eager_kv).score(batch, options)
    engine = training_engine("hf", info, EngineConfig(dtype="bf16", engine_args={"kv_quant": "fp8"}))
    assert engine.reconfigure({"kv_quant": "fp8", "attn_implementation": "eager"})
    assert engine.describe()["attn_implementation"] == "eager"
    assert engine.hf.config._attn_implementation.endswith("|eager")  # still wrapped by the K/V rounding
    assert _same(engine.score(batch, options), expected)


# ---- router_dtype=fp32 -----------------------------------------------------------------------------------------
def test_fp32_router_changes_routes_only_at_near_ties(near_ties):
    """At bf16 the fp32 router re-orders only experts the bf16 router had tied: in the first MoE layer (the same
    input on both sides) every changed expert set had a bf16 selection margin of (about) zero."""
    engine = training_engine("hf", load_model_info(near_ties), EngineConfig(dtype="bf16"))
    batch, options = _batch(), ScoreOptions(temperature=1.0)
    plain = engine.score(batch, options)
    assert engine.reconfigure({"router_dtype": "fp32"})
    fp32 = engine.score(batch, options)
    changed = np.concatenate(
        [np.any(np.sort(a.experts[:, 0], -1) != np.sort(b.experts[:, 0], -1), -1) for a, b in zip(plain, fp32)]
    )
    margins = np.concatenate([a.router_margin[:, 0] for a in plain])
    assert changed.sum() >= 3
    assert margins[changed].max() < 2**-10  # no expert set with a clear bf16 margin changed ...
    assert (margins >= 2**-10).mean() > 0.5  # ... and most had one


def test_fp32_router_replay_forces_the_replayed_experts(near_ties):
    """R3 and R2 hand the engine other experts: the fp32 router still routes to exactly them, and replaying
    its own choice reproduces its own pass bit for bit."""
    engine = training_engine("hf", load_model_info(near_ties), EngineConfig(dtype="bf16"))
    batch, options = _batch(seed=3), ScoreOptions(temperature=1.0)
    plain = engine.score(batch, options)
    assert engine.reconfigure({"router_dtype": "fp32", "lm_head_dtype": "fp32"})
    natural = engine.score(batch, options)
    assert not all(np.array_equal(a.experts, b.experts) for a, b in zip(plain, natural))
    forced = engine.score(_replayed(batch, plain), options)
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(plain, forced))
    assert _same(engine.score(_replayed(batch, natural), options), natural)


def test_r3_and_r2_passes_with_knobs_route_as_replayed(near_ties, tmp_path):
    run = _generate(near_ties, tmp_path / "run", "--samples-per-prompt", 4, "--max-new-tokens", 16)
    knobs = ("--engine-arg", "router_dtype=fp32", "--engine-arg", "lm_head_dtype=fp32")
    _rescore(run, "r3", "--dtype", "bf16", "--replay", "r3", *knobs)
    facts = _engine_facts(run / "scores" / "r3")
    assert (facts["router_dtype"], facts["lm_head_dtype"]) == ("fp32", "fp32")
    rollout, valid_r = expert_sets(pl.read_parquet(run / "rollout"), 2, 2)
    scored, valid_s = expert_sets(pl.read_parquet(run / "scores" / "r3" / "*.parquet"), 2, 2)
    both = valid_r & valid_s
    assert both.sum() >= 20 and np.array_equal(rollout[both], scored[both])  # router diff exactly 0

    def rescore(name: str, engine_args: dict, **job) -> np.ndarray:
        config = EngineConfig(dtype="bf16", batch_size=8, engine_args=engine_args)
        run_rescore(RescoreJob(run=run, engine="hf", config=config, name=name, **job))
        return expert_sets(pl.read_parquet(run / "scores" / name / "*.parquet"), 2, 2)[0]

    old = rescore("old", {}, replay=NO_REPLAY)
    fp32 = {"router_dtype": "fp32"}
    natural = rescore("natural", fp32, replay=NO_REPLAY)
    r2 = rescore("r2", fp32, model=near_ties, old="old", policy_step=0, replay=R2)
    assert not np.array_equal(natural, old)  # the fp32 router alone would route otherwise
    assert np.array_equal(r2, old)
