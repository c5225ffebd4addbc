"""Every MoE family end to end on a tiny random-init checkpoint: the config's MoE layers, capture against
a naive recomputation of the router's choice, bitwise self-replay, and R3 from a bf16 rollout."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from moe_families import FAMILIES, expert_sets, naive_choice, naive_margin, save_family
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines import inference_engine, training_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.hf import routing as hf_routing
from mismatch_probe.model.hf_config import load_hf_config
from mismatch_probe.model.moe import adapter_for
from mismatch_probe.model.moe.recognise import meta_model, recognise_checkpoint
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest

pytestmark = pytest.mark.slow  # a tiny model of each of 13 families, several engines each

runner = CliRunner()
PROMPTS = [[5, 9, 17, 33], [7, 40], [100, 3, 250, 64, 12]]


def _needs_newer_transformers(name: str):
    """A skip mark where the installed transformers is older than the family's routers need (the lowest CI lane)."""
    need = adapter_for(name).min_transformers
    have = hf_routing.transformers_version()
    older = need is not None and hf_routing._release(have) < hf_routing._release(need)
    return pytest.mark.skipif(older, reason=f"{name} routers need transformers >= {need}; installed {have}")


@pytest.fixture(
    scope="module", params=[pytest.param(f, id=f.name, marks=_needs_newer_transformers(f.name)) for f in FAMILIES]
)
def family(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param.name))


def test_config_gives_the_moe_layers(family):
    spec, path = family
    info = load_model_info(path)
    assert info.moe_layer_indices == spec.moe_layers
    assert (info.num_experts, info.top_k) == ((4, 1) if spec.name == "llama4_text" else (8, 2))
    assert info.manifest_fields()["moe_layer_indices"] == list(spec.moe_layers)


def test_family_is_recognised_from_its_modules(family):
    """What a checkpoint whose model_type names no family relies on: its module tree (built without weights)
    names the family, and the family's adapter reads the router it finds."""
    spec, path = family
    config = load_hf_config(path)
    recognised = recognise_checkpoint(config, trust_remote_code=False)
    adapter = recognised.adapter
    assert adapter.family == load_model_info(path).moe_family and recognised.misfits == ()
    # The table's block class holds the table's router class where the table says.
    blocks = [m for m in meta_model(config, False).modules() if type(m).__name__ in adapter.block_classes]
    assert len(blocks) == len(spec.moe_layers)
    assert {type(getattr(block, adapter.router_attr)).__name__ for block in blocks} == {spec.router_class}


def test_capture_equals_the_routers_own_choice(family):
    spec, path = family
    engine = inference_engine("hf", load_model_info(path), EngineConfig(dtype="fp32", batch_size=3))
    naive = []  # per MoE layer, per router call: the expert sets recomputed from the router's own logits
    margins = []  # ... and the selection margins
    for module in engine.hf.modules():
        if type(module).__name__ == spec.router_class:
            calls, margin_calls = [], []
            naive.append(calls)
            margins.append(margin_calls)
            module.register_forward_hook(lambda m, i, out, calls=calls: calls.append(naive_choice(spec, m, out)))
            module.register_forward_hook(lambda m, i, out, c=margin_calls: c.append(naive_margin(spec, m, out)))
    requests = [PromptRequest(i, i, ids) for i, ids in enumerate(PROMPTS)]
    records = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=5, seed=3))
    captured = engine.tap.layer_calls()
    assert len(captured) == len(naive) == len(spec.moe_layers)
    for layer_calls, layer_naive in zip(captured, naive):
        assert len(layer_calls) == len(layer_naive) >= 2  # prefill and decode steps
        for call, expected in zip(layer_calls, layer_naive):
            assert [set(row) for row in call.tolist()] == expected
    for layer_margins, layer_naive in zip(engine.tap.layer_margins(), margins):  # prefill and every decode step
        assert len(layer_margins) == len(layer_naive)
        for call, expected in zip(layer_margins, layer_naive):
            np.testing.assert_allclose(call.numpy(), expected, rtol=1e-4, atol=1e-6)
    for record in records:
        assert record.experts.shape[1:] == (len(spec.moe_layers), 1 if spec.name == "llama4_text" else 2)
        assert record.experts_valid.sum() == len(record.token_ids) - 1  # the last sampled token is never forwarded


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_replaying_own_routing_reproduces_log_probs_bitwise(family, dtype):
    spec, path = family
    engine = training_engine("hf", load_model_info(path), EngineConfig(dtype=dtype))
    rng = np.random.default_rng(4)
    batch = [ScoreRequest(i, i, rng.integers(2, 256, 8 + 3 * i), prompt_len=3 + i) for i in range(3)]
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    replayed = engine.score(
        [
            ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len, f.experts, np.ones(len(r), bool))
            for r, f in zip(batch, free)
        ],
        ScoreOptions(temperature=1.0),
    )
    for f, r in zip(free, replayed):
        assert np.array_equal(f.logprob, r.logprob)  # bitwise: the replayed gate weights are the model's own
        assert np.array_equal(f.experts, r.experts)


@pytest.mark.parametrize("replay", [False, True])
def test_router_margin_equals_a_naive_recomputation_from_the_logits(family, replay):
    spec, path = family
    engine = training_engine("hf", load_model_info(path), EngineConfig(dtype="fp32"))
    naive = []  # per MoE layer: each token's margin from the logits the router returned
    for module in engine.hf.modules():
        if type(module).__name__ == spec.router_class:
            naive.append([])
            module.register_forward_hook(lambda m, i, out, calls=naive[-1]: calls.extend(naive_margin(spec, m, out)))
    rng = np.random.default_rng(5)
    lengths = (7, 10)
    forced = [rng.integers(0, 8 if spec.name != "llama4_text" else 4, (n, len(spec.moe_layers), 1)) for n in lengths]
    batch = [
        ScoreRequest(
            i,
            i,
            rng.integers(2, 256, n),
            prompt_len=3,
            replay_experts=forced[i] if replay else None,
            replay_valid=np.ones(n, bool) if replay else None,
        )
        for i, n in enumerate(lengths)
    ]
    if replay and spec.name != "llama4_text":  # top-2: two distinct experts per slot
        for request in batch:
            request.replay_experts = np.concatenate([request.replay_experts, (request.replay_experts + 1) % 8], -1)
    records = engine.score(batch, ScoreOptions(temperature=1.0))
    width = max(lengths)  # left padding: row i's position p sits at grid column width - n + p
    for row, (record, n) in enumerate(zip(records, lengths)):
        assert record.router_margin.shape == (n, len(spec.moe_layers)) and record.router_margin.dtype == np.float32
        expected = np.array([layer[row * width + width - n : (row + 1) * width] for layer in naive]).T
        np.testing.assert_allclose(record.router_margin, expected, rtol=1e-4, atol=1e-6)
        assert np.nanmin(record.router_margin) >= 0


def test_r3_from_a_bf16_rollout_gives_zero_router_diff(family, tmp_path):
    spec, path = family
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in PROMPTS))
    run = tmp_path / "run"
    for args in (
        [
            "generate",
            "--model",
            path,
            "--prompts",
            prompts,
            "--out",
            run,
            "--dtype",
            "bf16",
            "--max-new-tokens",
            5,
            "--seed",
            1,
        ],
        ["rescore", run, "--dtype", "fp32", "--replay", "r3"],
    ):
        result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["moe_layer_indices"] == list(spec.moe_layers)
    layers, k = len(spec.moe_layers), manifest["top_k"]
    rollout, valid_r = expert_sets(pl.read_parquet(run / "rollout"), layers, k)
    scored, valid_s = expert_sets(pl.read_parquet(run / "scores" / "hf-fp32-r3" / "*.parquet"), layers, k)
    both = valid_r & valid_s
    assert both.sum() >= 20 and valid_s.all()
    assert np.array_equal(rollout[both], scored[both])  # router diff exactly 0
    for side, routed in (("rollout", valid_r), ("scores/hf-fp32-r3", valid_s)):  # both hf sides write margins
        margins = pl.read_parquet(run / side / "*.parquet")["router_margin"]
        assert np.array_equal(margins.is_not_null().to_numpy(), routed)
        values = np.stack(margins.drop_nulls().to_list())
        assert values.shape == (routed.sum(), layers) and np.nanmin(values) >= 0


SOFTMAX_FAMILIES = {"qwen3_moe", "qwen2_moe", "qwen3_next", "mixtral", "olmoe", "ernie4_5_moe", "hunyuan_v1_moe"}


def test_router_logprobs_are_read_from_every_softmax_family():
    readable = {f.name for f in FAMILIES if hasattr(adapter_for(f.name).style, "router_logprobs")}
    assert readable == SOFTMAX_FAMILIES  # the sigmoid families are refused (tests/test_policy.py)


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(f, id=f.name, marks=_needs_newer_transformers(f.name))
        for f in FAMILIES
        if f.name in SOFTMAX_FAMILIES
    ],
)
def test_router_logprobs_equal_a_float64_softmax_of_the_routers_own_linear(spec, replay, tmp_path):
    """`--router-logprobs` (RSPO's log r(e | c)) against log_softmax(x · Wᵀ) in float64 from each router's
    input and weight: at the experts each row took (its own, or the replayed ones) and at the --old set's."""
    path = save_family(spec, tmp_path / spec.name)
    engine = training_engine("hf", load_model_info(path), EngineConfig(dtype="fp32"))
    reference = []  # per MoE layer: [tokens, experts] float64 log-probs from the router's input
    for module in engine.hf.modules():
        if type(module).__name__ == spec.router_class:
            reference.append([])
            weight = module.weight if hasattr(module, "weight") else module.wg.weight

            def keep(m, inputs, calls=reference[-1], weight=weight):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
                calls.append(torch.log_softmax(x @ weight.double().T, dim=-1))

            module.register_forward_pre_hook(keep)
    rng = np.random.default_rng(6)
    lengths, layers = (6, 9), len(spec.moe_layers)

    def distinct(n):  # top-2: two different experts per (token, layer)
        first = rng.integers(0, 8, (n, layers, 1))
        return np.concatenate([first, (first + rng.integers(1, 8, first.shape)) % 8], -1)

    batch = [
        ScoreRequest(
            sample_id=i,
            prompt_id=i,
            token_ids=rng.integers(2, 256, n),
            prompt_len=3,
            replay_experts=distinct(n) if replay else None,
            replay_valid=np.ones(n, bool) if replay else None,
            old_experts=distinct(n),
        )
        for i, n in enumerate(lengths)
    ]
    records = engine.score(batch, ScoreOptions(temperature=1.0, router_logprobs=True))
    width = max(lengths)  # left padding: row i's position p sits at grid column width - n + p
    for row, (request, record, n) in enumerate(zip(batch, records, lengths)):
        if replay:
            assert np.array_equal(record.experts, request.replay_experts)
        full = np.stack([layer[0][row * width + width - n : (row + 1) * width].numpy() for layer in reference], 1)
        assert record.expert_logprobs.shape == record.expert_logprobs_at_old.shape == (n, layers, 2)
        for got, experts in (
            (record.expert_logprobs, record.experts),
            (record.expert_logprobs_at_old, request.old_experts),
        ):
            np.testing.assert_allclose(got, np.take_along_axis(full, experts.astype(np.int64), -1), rtol=0, atol=2e-5)
        assert (record.expert_logprobs <= 0).all()
