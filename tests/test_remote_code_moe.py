"""Checkpoints that ship their own modeling code (--trust-remote-code): the MoE family is recognised from the
model's modules (class names along each class's bases, then a run of its router through the family's adapter),
`--moe-family` names it where nothing else does, and an MoE no adapter reads exits 2, never measured dense."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from conftest import DEMO_PROMPTS
from moe_families import expert_sets
from remote_code_models import (
    copied_dense,
    copied_kimi_k2,
    copied_phimoe,
    deepseek_own_gate,
    renamed_mixtral,
    tuned_qwen3_moe,
)
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.model.moe import adapter_chosen, supported_names
from mismatch_probe.model.moe.base import MoeShape
from mismatch_probe.model.moe.recognise import router_misfit
from mismatch_probe.model.routing_shape import load_model_info

pytestmark = pytest.mark.slow  # remote-code checkpoints generated and replayed

runner = CliRunner()
KNOWN = (
    "qwen3_moe, qwen2_moe, qwen3_next, mixtral, olmoe, deepseek_v3, kimi_k2, glm4_moe, dots1, gpt_oss, "
    "llama4_text, llama4, ernie4_5_moe, hunyuan_v1_moe"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    return {
        name: build(root / name)
        for name, build in (
            ("kimi-k2-copy", copied_kimi_k2),
            ("tuned-qwen3-moe", tuned_qwen3_moe),
            ("tiny-mixtral", renamed_mixtral),
            ("mystery-moe", copied_phimoe),
            ("kimi-k2-own-gate", deepseek_own_gate),
            ("own-dense", copied_dense),
            ("own-moe-own-gate", lambda path: deepseek_own_gate(path, "own_moe")),
        )
    }


def _probe(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


def _generate(model, out, *extra) -> tuple[int, str]:
    return _probe(
        "generate",
        "--model",
        model,
        "--prompts",
        DEMO_PROMPTS,
        "--num-prompts",
        4,
        "--samples-per-prompt",
        2,
        "--max-new-tokens",
        6,
        "--seed",
        1,
        "--dtype",
        "bf16",
        "--out",
        out,
        "--trust-remote-code",
        *extra,
    )


def _generate_and_replay(model, run, *extra) -> None:
    """A bf16 rollout, then an fp32 rescore replaying its routing: the replayed experts are the rollout's."""
    assert _generate(model, run, *extra)[0] == 0
    code, output = _probe("rescore", run, "--dtype", "fp32", "--replay", "r3", "--trust-remote-code", *extra)
    assert code == 0, output
    manifest = json.loads((run / "manifest.json").read_text())
    layers, k = len(manifest["moe_layer_indices"]), manifest["top_k"]
    rollout, routed = expert_sets(pl.read_parquet(run / "rollout"), layers, k)
    replayed, scored = expert_sets(pl.read_parquet(run / "scores" / "hf-fp32-r3" / "*.parquet"), layers, k)
    assert routed.sum() >= 40 and scored.all()  # the rollout recorded routing for every forwarded token
    assert np.array_equal(rollout[routed], replayed[routed])  # router diff exactly 0


def test_kimi_k2_copying_deepseek_v3_classes_is_recorded_and_replayed(checkpoints, tmp_path):
    path = checkpoints["kimi-k2-copy"]
    info = load_model_info(path, trust_remote_code=True)
    assert (info.model_type, info.moe_family, info.moe_layer_indices) == ("kimi_k2", "DeepSeek-V3 / Kimi-K2", (2, 3))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = load_hf_model(info, "fp32").model.layers[2].mlp.gate
    assert type(router).__name__ == "DeepseekV3TopkRouter" and not isinstance(router, DeepseekV3TopkRouter)
    _generate_and_replay(path, tmp_path / "run")


def test_fine_tune_with_its_own_model_type_is_recognised_by_its_modules(checkpoints, tmp_path):
    """Subclasses of Qwen3-MoE's block and router under new names: the block's bases name the family."""
    info = load_model_info(checkpoints["tuned-qwen3-moe"], trust_remote_code=True)
    assert (info.model_type, info.architecture) == ("tuned_qwen3_moe", "TunedForCausalLM")
    assert (info.moe_family, info.moe_layer_indices, info.num_experts, info.top_k) == ("Qwen3-MoE", (0, 2, 3), 8, 2)
    _generate_and_replay(checkpoints["tuned-qwen3-moe"], tmp_path / "run")
    assert _probe("rescore", tmp_path / "run", "--trust-remote-code", "--moe-family", "qwen9") == (
        2,
        f"error: --moe-family: 'qwen9' is not a known MoE family; known: {KNOWN}",
    )


def test_moe_family_names_the_family_when_nothing_else_does(checkpoints, tmp_path):
    """Every class renamed and a model_type of its own: refused, until --moe-family names the family."""
    path = checkpoints["tiny-mixtral"]
    assert _generate(path, tmp_path / "refused") == (
        2,
        (
            f"error: {path / 'config.json'}: 'TinyForCausalLM' (model_type 'tiny_moe') has experts "
            f"(num_local_experts=8) but no MoE routing adapter; supported: {supported_names()}; if it routes as one of "
            f"them, name it with --moe-family"
        ),
    )
    assert not (tmp_path / "refused").exists()
    _generate_and_replay(path, tmp_path / "run", "--moe-family", "mixtral")


def test_unknown_moe_exits_2_even_when_named_as_a_family(checkpoints, tmp_path):
    path = checkpoints["mystery-moe"]
    assert _generate(path, tmp_path / "run") == (
        2,
        (
            f"error: {path / 'config.json'}: 'PhimoeForCausalLM' (model_type 'mystery_moe') has experts "
            f"(num_local_experts=4) but no MoE routing adapter; supported: {supported_names()}; if it routes as one of "
            f"them, name it with --moe-family"
        ),
    )
    # PhiMoE's router weights its experts otherwise than Mixtral's: running it through the adapter shows it.
    assert _generate(path, tmp_path / "run", "--moe-family", "Mixtral") == (
        2,
        (
            f"error: {path.resolve()}: 'PhimoeForCausalLM' has router modules (model.layers.0.mlp.router: "
            f"PhimoeTopKRouter) that the Mixtral adapter cannot read: replaying its own choice changes output 1: it does "
            f"not weight experts as Mixtral routers do"
        ),
    )


def test_router_under_the_family_block_that_routes_otherwise_is_refused(checkpoints, tmp_path):
    """DeepSeek-V3's block with a router of another output layout (expert ids, weights): never read as if it fit."""
    path = checkpoints["kimi-k2-own-gate"]
    assert _generate(path, tmp_path / "run") == (
        2,
        (
            f"error: {path.resolve()}: router model.layers.2.mlp.gate (MoEGate) of 'OwnForCausalLM' does not work as "
            f"the DeepSeek-V3 / Kimi-K2 adapter reads it: reading it as DeepSeek-V3 / Kimi-K2 fails (IndexError: tuple "
            f"index out of range)"
        ),
    )


def test_family_names_on_modules_whose_router_routes_otherwise_are_refused(checkpoints, tmp_path):
    """The same under a model_type of its own: the block's bases say DeepSeek-V3, its router says otherwise."""
    path = checkpoints["own-moe-own-gate"]
    assert _generate(path, tmp_path / "run") == (
        2,
        (
            f"error: {path / 'config.json'}: 'OwnForCausalLM' (model_type 'own_moe') has experts (n_routed_experts=8) "
            f"but no MoE routing adapter (model.layers.2.mlp (OwnMoE) looks like DeepSeek-V3 / Kimi-K2, but reading it "
            f"as DeepSeek-V3 / Kimi-K2 fails (IndexError: tuple index out of range)); supported: {supported_names()}; "
            f"if it routes as one of them, name it with --moe-family"
        ),
    )


def test_unknown_moe_family_name_exits_2_listing_the_known_ones(checkpoints, tmp_path):
    assert _generate(checkpoints["tuned-qwen3-moe"], tmp_path / "run", "--moe-family", "qwen9") == (
        2,
        f"error: --moe-family: 'qwen9' is not a known MoE family; known: {KNOWN}",
    )


def test_dense_remote_code_stays_dense(checkpoints):
    info = load_model_info(checkpoints["own-dense"], trust_remote_code=True)
    assert (info.model_type, info.moe_family, info.moe_layer_indices) == ("own_dense", None, ())


def test_the_adapter_check_runs_the_router():
    """Qwen2-MoE without top-k renormalisation read as Mixtral (which always renormalises): the class fits the
    output layout, the weights do not."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    config = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    router = Qwen2MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    shape = MoeShape(num_experts=8, top_k=2, moe_layers=(0,))
    assert router_misfit(adapter_chosen("qwen2_moe"), router, 16, shape) is None
    assert router_misfit(adapter_chosen("mixtral"), router, 16, shape) == (
        "replaying its own choice changes output 1: it does not weight experts as Mixtral routers do"
    )
    assert router_misfit(
        adapter_chosen("qwen2_moe"), router, 16, MoeShape(num_experts=8, top_k=4, moe_layers=(0,))
    ) == ("it picks 2 of 8 experts per token where config.json says 4 of 8")
