"""MoE shapes read from hand-written configs, and the refusals: a model is never measured as dense
while it has routers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import REPO
from moe_families import FAMILIES, save_family
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.engines.hf.routing import attach_router_tap
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.moe import ADAPTERS, supported_names
from mismatch_probe.model.moe.support import support_matrix
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info

runner = CliRunner()


def _write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize(
    "fields, layers, experts, top_k",
    [
        # Llama-4 nests the text model under text_config; every 2nd layer by default, or the listed ones.
        (
            dict(
                model_type="llama4",
                architectures=["Llama4ForConditionalGeneration"],
                text_config=dict(
                    model_type="llama4_text",
                    num_hidden_layers=6,
                    vocab_size=300,
                    num_local_experts=4,
                    num_experts_per_tok=1,
                    interleave_moe_layer_step=2,
                ),
            ),
            (1, 3, 5),
            4,
            1,
        ),
        (
            dict(
                model_type="llama4_text",
                num_hidden_layers=6,
                vocab_size=300,
                num_local_experts=4,
                num_experts_per_tok=1,
                moe_layers=[0, 5],
            ),
            (0, 5),
            4,
            1,
        ),
        # ERNIE: (i + 1) % interval == 0 and start <= i <= end, end -1 meaning the last layer.
        (
            dict(
                model_type="ernie4_5_moe",
                num_hidden_layers=6,
                vocab_size=300,
                moe_num_experts=8,
                moe_k=2,
                moe_layer_start_index=2,
                moe_layer_end_index=-1,
                moe_layer_interval=2,
            ),
            (3, 5),
            8,
            2,
        ),
        # DeepSeek-V3 without first_k_dense_replace: the class default (3 dense layers) applies, as in the model.
        (
            dict(
                model_type="deepseek_v3", num_hidden_layers=5, vocab_size=300, n_routed_experts=8, num_experts_per_tok=2
            ),
            (3, 4),
            8,
            2,
        ),
        # Kimi-K2: a model type transformers does not register, read as DeepSeek-V3.
        (
            dict(
                model_type="kimi_k2",
                architectures=["DeepseekV3ForCausalLM"],
                num_hidden_layers=4,
                vocab_size=300,
                n_routed_experts=16,
                num_experts_per_tok=4,
                first_k_dense_replace=1,
            ),
            (1, 2, 3),
            16,
            4,
        ),
        (
            dict(
                model_type="qwen2_moe",
                num_hidden_layers=6,
                vocab_size=300,
                num_experts=8,
                num_experts_per_tok=2,
                decoder_sparse_step=2,
                mlp_only_layers=[3],
            ),
            (1, 5),
            8,
            2,
        ),
        (
            dict(model_type="hunyuan_v1_moe", num_hidden_layers=3, vocab_size=300, num_experts=8, moe_topk=[2, 2, 2]),
            (0, 1, 2),
            8,
            2,
        ),
    ],
)
def test_moe_shape_from_config(tmp_path, fields, layers, experts, top_k):
    info = load_model_info(_write_config(tmp_path / "m", **fields))
    assert (info.moe_layer_indices, info.num_experts, info.top_k) == (layers, experts, top_k)


def test_per_layer_top_k_that_differs_is_refused(tmp_path):
    path = _write_config(
        tmp_path / "m",
        model_type="hunyuan_v1_moe",
        num_hidden_layers=3,
        vocab_size=300,
        num_experts=8,
        moe_topk=[2, 1, 2],
    )
    with pytest.raises(ProbeError) as err:
        load_model_info(path)
    assert (
        str(err.value) == f"{path / 'config.json'}: 'moe_topk' differs between layers ([2, 1, 2]); expected one value"
    )


def test_kimi_k2_checkpoint_loads_as_deepseek_v3(tmp_path):
    kimi = next(f for f in FAMILIES if f.name == "kimi_k2")
    info = load_model_info(save_family(kimi, tmp_path / "kimi"))
    assert info.model_type == "kimi_k2" and info.moe_family == "DeepSeek-V3 / Kimi-K2"
    assert type(load_hf_model(info, "fp32")).__name__ == "DeepseekV3ForCausalLM"


def test_unknown_model_type_exits_2_with_the_remote_code_hint(tmp_path):
    model = _write_config(tmp_path / "m", model_type="foo_moe", num_hidden_layers=2, vocab_size=10)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    result = runner.invoke(
        app, ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = " ".join(result.output.split())  # rich wraps long lines
    assert line.startswith(f"error: {model / 'config.json'}: transformers cannot read it (")
    assert line.endswith("if the checkpoint ships its own code, pass --trust-remote-code")


def _tiny_phimoe(path):
    from transformers import AutoModelForCausalLM, PhimoeConfig

    torch.manual_seed(0)
    config = PhimoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_moe_family_without_adapter_exits_2_never_dense(tmp_path):
    model = _tiny_phimoe(tmp_path / "phimoe")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [3, 4]}\n')
    result = runner.invoke(
        app, ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert " ".join(result.output.split()) == (
        f"error: {model / 'config.json'}: 'PhimoeForCausalLM' (model_type 'phimoe') has experts "
        f"(num_local_experts=4) but no MoE routing adapter; supported: {supported_names()}; if it routes as one of "
        f"them, name it with --moe-family"
    )


def _tap_refusal(loaded: ModelInfo, claimed: ModelInfo) -> str:
    with pytest.raises(ProbeError) as err:
        attach_router_tap(load_hf_model(loaded, "fp32"), claimed)
    return str(err.value)


def test_router_modules_without_adapter_are_refused(tmp_path):
    path = _tiny_phimoe(tmp_path / "phimoe").resolve()
    # What a config without expert keys (remote code, say) would give: no adapter, no MoE layers.
    info = ModelInfo(
        path=path,
        model_type="phimoe",
        architecture="PhimoeForCausalLM",
        num_hidden_layers=2,
        vocab_size=64,
        moe_layer_indices=(),
        top_k=0,
        num_experts=0,
        config_hash="0",
    )
    assert _tap_refusal(info, info) == (
        f"{path}: 'PhimoeForCausalLM' has router modules (model.layers.0.mlp.router: PhimoeTopKRouter) but no "
        f"MoE routing adapter for model_type 'phimoe'; supported: {supported_names()}; if it routes as one of them, "
        f"name it with --moe-family"
    )


def test_config_saying_dense_while_model_has_routers_is_refused(tiny_moe):
    info = load_model_info(tiny_moe)
    dense = dataclasses.replace(info, moe_layer_indices=(), top_k=0, num_experts=0)
    assert _tap_refusal(info, dense) == (
        f"{info.path}: config.json of 'Qwen3MoeForCausalLM' says dense (no MoE layers), but the model has "
        f"routers in layers [0, 2]"
    )


@pytest.mark.parametrize("name", ["deepseek_v3", "ernie4_5_moe"])
def test_family_newer_than_the_installed_transformers_is_one_line(tmp_path, monkeypatch, name):
    """Families whose routers return (logits, weights, experts) only from transformers 5.13 on: older ones are
    refused naming the release and the install command, before any router is read."""
    from mismatch_probe.engines.hf import routing as hf_routing

    info = load_model_info(save_family(next(f for f in FAMILIES if f.name == name), tmp_path / name))
    hf = load_hf_model(info, "fp32")
    have = hf_routing.transformers_version()
    if tuple(int(part) for part in have.split(".")[:2]) >= (5, 13):  # the lowest CI lane has an older one
        assert attach_router_tap(hf, info) is not None  # this environment's transformers reads them
        have = "5.12.0"
        monkeypatch.setattr(hf_routing, "transformers_version", lambda: have)
    with pytest.raises(ProbeError) as err:
        attach_router_tap(hf, info)
    assert str(err.value) == (
        f"{info.path}: reading the routers of {info.moe_family} models with the hf engine needs transformers >= 5.13 "
        f"(this environment has {have}): pip install 'transformers>=5.13'"
    )


def test_dense_model_gets_no_tap(tiny_dense):
    info = load_model_info(tiny_dense)
    assert info.moe_family is None and info.moe_layer_indices == ()
    assert attach_router_tap(load_hf_model(info, "fp32"), info) is None


def test_readme_support_matrix_is_the_rendered_adapter_table():
    readme = (REPO / "docs" / "engines.md").read_text()  # the README links it
    start = readme.index("\n", readme.index("<!-- support-matrix:start")) + 1
    assert readme[start : readme.index("<!-- support-matrix:end -->")] == support_matrix()


def test_every_adapter_has_an_end_to_end_family_test():
    tested = {family.name for family in FAMILIES}
    assert all(tested & set(adapter.model_types) for adapter in ADAPTERS)
    assert len(ADAPTERS) == 12


def test_megatron_columns_agree_with_the_megatron_adapter_table():
    """The support matrix says megatron builds a family exactly when megatron_adapters maps its architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from mismatch_probe.engines.megatron.adapters import ADAPTERS as MEGATRON_ADAPTERS
    from mismatch_probe.engines.megatron.adapters import NOT_BUILDABLE
    from mismatch_probe.model.moe.families import ADAPTERS, MODEL_TYPE_ALIASES

    for adapter in ADAPTERS:
        model_type = MODEL_TYPE_ALIASES.get(adapter.model_types[0], adapter.model_types[0])
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        assert adapter.megatron == (architecture in MEGATRON_ADAPTERS), adapter.family
        assert adapter.megatron_r3 == adapter.megatron, adapter.family
        if not adapter.megatron:
            assert architecture in NOT_BUILDABLE, adapter.family
