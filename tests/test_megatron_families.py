"""megatron-core against transformers, family by family, on tiny random-init checkpoints (fp32).

For each family: the log-probs agree to 1e-4, megatron routes every token to the experts the HF
router chose (router diff 0), and R3 replays given routing with the family's own gate weights: a
megatron forward that replays foreign routing matches an HF forward whose routers are forced to
the same experts, the forced gate weights recomputed here by hand from the router logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_MOE

from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import ScoreRequest

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from mismatch_probe.engines.megatron.training import MegatronTrainingEngine  # noqa: E402

pytestmark = pytest.mark.slow  # megatron-core for every family, one and two processes

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    tie_word_embeddings=False,
)

FAMILIES = {
    # Group-limited: 4 groups of 2 experts, 2 groups chosen, top-4; MLA with q LoRA, interleaved rope.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    # Kimi-K2-like: one group, YaRN RoPE; full-rank q projection and non-interleaved rope rows.
    "deepseek_v3_plain_q": lambda: transformers.DeepseekV3Config(
        **COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
        },
        max_position_embeddings=32,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        n_shared_experts=2,
        routed_scaling_factor=1.8,
        rope_interleave=False,
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Qwen3 attention under the DeepSeek-V3 router; the sliding-window default is for later layers only.
    "dots1": lambda: transformers.Dots1Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.0,
        norm_topk_prob=True,
    ),
    # Sinks, a 4-token window on layers 0 and 2, YaRN; biased clamped-SwiGLU experts with gate/up interleaved.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**COMMON, "intermediate_size": 32},
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
}


def _save(config, path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # wider than the default init: routing is not flat
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.15)
            elif "norm" in name:
                torch.nn.init.uniform_(p, 0.5, 1.5)
            else:  # biases
                torch.nn.init.normal_(p, std=0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero: selection differs from weighting
                buffer.copy_(torch.linspace(-0.15, 0.15, buffer.numel())[torch.randperm(buffer.numel())])
    model.save_pretrained(path)
    return path


MOE_LAYERS = {
    "deepseek_v3": [1, 2],
    "deepseek_v3_plain_q": [2],
    "glm4_moe": [1, 2],
    "dots1": [1, 2],
    "gpt_oss": [0, 1, 2],
    "qwen3_moe": [1],
    "mixtral": [0, 1, 2],
    "qwen2_moe": [0, 2],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _save(FAMILIES[request.param](), tmp_path_factory.mktemp(request.param))


def _routers(model) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))]


def _gate_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The family's gate weights for given experts, written out from its HF router's definition."""
    if not hasattr(router, "norm_topk_prob"):  # gpt-oss: softmax over the chosen experts' logits
        return logits.gather(1, experts).softmax(-1)
    if hasattr(router, "e_score_correction_bias"):  # sigmoid: renormalised, scaled, bias never used
        scores = logits.sigmoid().gather(1, experts)
        return scores / (scores.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    probs = logits.softmax(-1).gather(1, experts)
    return probs / probs.sum(-1, keepdim=True) if router.norm_topk_prob else probs


def _naive_margins(router, logits: torch.Tensor) -> list[float]:
    """Each token's k-th minus (k+1)-th selection score, from the router's logits, one sorted row at a time."""
    rows = logits.double().numpy()
    if type(router).__name__ == "GptOssTopKRouter":  # gpt-oss ranks its logits
        scores = rows
    elif hasattr(router, "e_score_correction_bias"):  # sigmoid + bias, only in the groups it keeps
        scores = 1 / (1 + np.exp(-rows)) + router.e_score_correction_bias.double().numpy()
        groups = scores.reshape(len(rows), router.num_group, -1)
        best = np.sort(groups, -1)[..., -2:].sum(-1)
        kept = np.argsort(-best, -1)[:, : router.topk_group]
        allowed = np.zeros(best.shape, bool)
        np.put_along_axis(allowed, kept, True, -1)
        scores = np.where(np.repeat(allowed, groups.shape[-1], -1), scores, -np.inf)
    else:
        scores = np.exp(rows - rows.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    k, margins = router.top_k, []
    for row in scores.tolist():
        margin = sorted(row, reverse=True)[k - 1] - sorted(row, reverse=True)[k]
        margins.append(margin if np.isfinite(margin) else np.nan)  # all kept experts chosen: no margin
    return margins


def hf_forward(path: Path, tokens: np.ndarray, forced: np.ndarray | None = None, margins: list | None = None):
    """Log-probs at every position and the chosen experts `[n, moe layers, k]` of an HF fp32 forward;
    with `forced`, every router is made to choose those experts; `margins` collects each router's
    selection margins per token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chosen = []

    def hook(router, _inputs, out):
        logits, _, experts = out
        if margins is not None:
            margins.append(_naive_margins(router, logits))
        if forced is None:
            chosen.append(experts)
            return None
        experts = torch.as_tensor(forced[:, len(chosen)])
        chosen.append(experts)
        return logits, _gate_weights(router, logits, experts), experts

    hooks = [r.register_forward_hook(hook) for r in _routers(model)]
    ids = torch.as_tensor(tokens)[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    for h in hooks:
        h.remove()
    logprob = np.full(len(tokens), np.nan, dtype=np.float32)
    logprob[1:] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
    return logprob, torch.stack(chosen, 1).numpy()


def _batch(seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [ScoreRequest(i, i, rng.integers(0, VOCAB, n), 3) for i, n in enumerate([13, 8])]


def _replaying(batch, experts) -> list[ScoreRequest]:
    return [
        ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len, e, np.ones(len(r), bool))
        for r, e in zip(batch, experts)
    ]


def test_megatron_matches_transformers_and_replays_exactly(family):
    name, family = family
    engine = MegatronTrainingEngine(
        load_model_info(family), EngineConfig(dtype="fp32", engine_args={"logprob_chunk": 7})
    )
    built = [i for i, layer in enumerate(engine.module.decoder.layers) if type(layer.mlp).__name__ == "MoELayer"]
    assert built == MOE_LAYERS[name]
    batch = _batch()
    free = engine.score(batch, ScoreOptions(temperature=1.0, extra_padding=2))
    references = [hf_forward(family, r.token_ids) for r in batch]
    for record, (ref_lp, ref_experts) in zip(free, references):
        np.testing.assert_allclose(record.logprob[3:], ref_lp[3:], atol=1e-4, rtol=0)
        # HF's sigmoid routers take top-k unsorted: compare expert sets.
        np.testing.assert_array_equal(np.sort(record.experts, -1), np.sort(ref_experts, -1))

    # R3 from HF's own routing: same experts, same log-probs.
    own = engine.score(_replaying(batch, [e for _, e in references]), ScoreOptions(1.0))
    for record, (ref_lp, ref_experts) in zip(own, references):
        np.testing.assert_array_equal(record.experts, ref_experts)
        np.testing.assert_allclose(record.logprob[3:], ref_lp[3:], atol=1e-4, rtol=0)

    # R3 from foreign routing (every id shifted by one): megatron uses exactly those experts, with the
    # weights the family's router gives them, as an HF forward forced to the same routing does.
    foreign = [(e + 1) % engine.model.num_experts for _, e in references]
    forced = engine.score(_replaying(batch, foreign), ScoreOptions(1.0, extra_padding=1))
    for record, request, experts, (ref_lp, _) in zip(forced, batch, foreign, references):
        np.testing.assert_array_equal(record.experts, experts)
        margins = []  # under R3 the margin is still the router's own
        forced_lp, _ = hf_forward(family, request.token_ids, forced=experts, margins=margins)
        np.testing.assert_allclose(record.logprob[3:], forced_lp[3:], atol=1e-4, rtol=0)
        assert np.abs(record.logprob[3:] - ref_lp[3:]).max() > 1e-3  # the replay did change something
        np.testing.assert_allclose(record.router_margin, np.array(margins).T, atol=1e-4, rtol=1e-3)
    for record, request in zip(free, batch):
        margins = []
        hf_forward(family, request.token_ids, margins=margins)
        assert record.router_margin.shape == (len(request), len(MOE_LAYERS[name]))
        np.testing.assert_allclose(record.router_margin, np.array(margins).T, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, ep", [("deepseek_v3", 2, 1), ("glm4_moe", 1, 2)])
def test_two_process_gloo_matches_one_process(tmp_path, name, tp, ep):
    """TP=2 shards MLA's projections and the shared experts; EP=2 splits the experts under expert bias."""
    from test_megatron import assert_two_processes_match_one

    assert_two_processes_match_one(_save(FAMILIES[name](), tmp_path / name), tp, ep, tmp_path)


def _edited(path: Path, tmp_path: Path, **changes) -> Path:
    copy = Path(shutil.copytree(path, tmp_path / "edited"))
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    "changes, missing",
    [
        (
            {"norm_topk_prob": False},
            "unnormalised sigmoid top-k weights (norm_topk_prob false; megatron-core always renormalises)",
        ),
        (
            {"n_group": 4, "topk_group": 1},
            "group-limited routing with num_experts_per_tok // topk_group = 4 (HF scores "
            "a group by its top 2 experts, megatron-core by its top num_experts_per_tok "
            "// topk_group)",
        ),
    ],
)
def test_sigmoid_routing_megatron_cannot_reproduce_is_refused(tmp_path, changes, missing):
    edited = _edited(_save(FAMILIES["deepseek_v3"](), tmp_path / "ds"), tmp_path, **changes)
    with pytest.raises(ProbeError) as err:
        MegatronTrainingEngine(load_model_info(edited), EngineConfig(dtype="fp32"))
    assert str(err.value) == (
        f"{edited.resolve() / 'config.json'}: architecture 'DeepseekV3ForCausalLM' with "
        f"{missing} is not supported by the megatron engine"
    )


def test_rescore_of_a_family_megatron_cannot_build_exits_2(tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    config = transformers.OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = _save(config, tmp_path / "olmoe")
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    run = tmp_path / "run"
    runner = CliRunner()
    made = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(model),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--out",
            str(run),
            "--max-new-tokens",
            "3",
        ],
    )
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["rescore", str(run), "--engine", "megatron"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [
        f"error: {model.resolve() / 'config.json'}: architecture 'OlmoeForCausalLM' is not supported by the megatron "
        "engine: q/k RMSNorm over all heads together (megatron-core's qk_layernorm is per head)"
    ]


@pytest.mark.skipif(not (DEMO_MOE / "config.json").is_file(), reason="demo models not trained")
def test_fp16_on_the_demo_model_is_finite_and_closer_to_fp32_than_bf16():
    info = load_model_info(DEMO_MOE)
    batch = [ScoreRequest(r.sample_id, r.prompt_id, r.token_ids % info.vocab_size, 3) for r in _batch(seed=4)]
    fp32 = MegatronTrainingEngine(info, EngineConfig(dtype="fp32")).score(batch, ScoreOptions(1.0))
    # Replaying fp32's routing isolates the arithmetic: a flipped expert would move a log-prob by far more.
    replay = _replaying(batch, [r.experts for r in fp32])
    delta = {}
    for dtype in ("fp16", "bf16"):
        engine = MegatronTrainingEngine(info, EngineConfig(dtype=dtype))
        assert all(np.isfinite(r.logprob).all() for r in engine.score(batch, ScoreOptions(1.0)))
        half = engine.score(replay, ScoreOptions(1.0))
        delta[dtype] = np.concatenate([np.abs(a.logprob - b.logprob)[3:] for a, b in zip(fp32, half)])
    assert 0 < delta["fp16"].max() < 0.05
    assert delta["fp16"].mean() < delta["bf16"].mean() / 2  # 10 mantissa bits against 7
