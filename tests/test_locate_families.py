"""`probe locate` beyond the demo MoE model: one operation of one layer changed in a tiny checkpoint of another
family (tests/moe_families.py, vocabulary 512 so that the demo run's token ids fit), or of the dense demo model,
located to that layer and operation from `--json`.

One small run of the demo MoE model supplies the token ids; `--a hf:fp32:model=FAMILY` and
`--b hf:fp32:model=CHANGED` compare the family checkpoint with its changed copy on them. The faults are found by
the modules' own names (the family's router attribute from model/moe/families.py), and cover layer 0, the last
layer, dense layers of MoE models, shared experts, MLA attention, a router change too small to flip a choice,
the final norm and the LM head."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DENSE, DEMO_MOE, DEMO_PROMPTS
from moe_families import FAMILIES, save_family
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf import routing as hf_routing
from mismatch_probe.model.moe import adapter_for

runner = CliRunner()


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("locate_families") / "run"
    common = ["--num-prompts", 3, "--samples-per-prompt", 1, "--max-new-tokens", 8, "--seed", 3]
    result = probe("generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", out, "--dtype", "fp32", *common)
    assert result.exit_code == 0, result.output
    return out


def perturb(weight: torch.Tensor, relative: float, generator: torch.Generator) -> None:
    noise = torch.randn(weight.shape, generator=generator)
    weight += relative * weight.norm() / noise.norm() * noise


def block(model, layer: int):
    decoder_layer = model.model.layers[layer]
    return getattr(decoder_layer, "mlp", None) or decoder_layer.feed_forward


def router_weight(family: str, model, layer: int) -> torch.Tensor:
    router = getattr(block(model, layer), adapter_for(family).router_attr)
    return next(p for name, p in router.named_parameters() if name.endswith("weight"))


def attention(proj: str, layer: int, relative: float = 1e-3):
    return lambda family, m, g: perturb(getattr(m.model.layers[layer].self_attn, proj).weight, relative, g)


def router(layer: int, relative: float):
    return lambda family, m, g: perturb(router_weight(family, m, layer), relative, g)


def experts_to_bf16(layer: int):
    def change(family, model, generator):
        for weight in block(model, layer).experts.parameters():
            weight.copy_(weight.to(torch.bfloat16).float())

    return change


def shared_expert(layer: int):
    def change(family, model, generator):
        moe = block(model, layer)
        shared = next(getattr(moe, n) for n in ("shared_expert", "shared_experts", "shared_mlp") if hasattr(moe, n))
        perturb(shared.down_proj.weight, 1e-3, generator)

    return change


def dense_mlp(layer: int):
    return lambda family, m, g: perturb(block(m, layer).down_proj.weight, 1e-3, g)


def lm_head(family, model, generator):
    perturb(model.lm_head.weight, 1e-3, generator)


def final_norm(family, model, generator):
    perturb(model.model.norm.weight, 1e-3, generator)


def _newer(name: str):
    need = adapter_for(name).min_transformers
    have = hf_routing.transformers_version()
    older = need is not None and hf_routing._release(have) < hf_routing._release(need)
    return pytest.mark.skipif(older, reason=f"{name} routers need transformers >= {need}; installed {have}")


# (family or "dense", the change, where it must be located)
CASES = [
    ("mixtral", attention("o_proj", 0), (0, "attention")),  # layer 0
    ("mixtral", lm_head, (None, "logits")),
    ("mixtral", final_norm, (None, "final_norm")),
    ("deepseek_v3", attention("kv_b_proj", 3), (3, "attention")),  # MLA, the last layer
    ("deepseek_v3", dense_mlp(0), (0, "mlp")),  # first_k_dense_replace: a dense layer of an MoE model
    ("deepseek_v3", router(2, 1e-3), (2, "router")),  # too small to flip a choice: by the router's scores
    ("olmoe", experts_to_bf16(3), (3, "mlp")),
    ("qwen2_moe", shared_expert(1), (1, "mlp")),
    ("qwen2_moe", router(3, 0.3), (3, "router")),
    ("gpt_oss", router(1, 0.3), (1, "router")),
    ("dense", dense_mlp(3), (3, "mlp")),
    ("dense", attention("q_proj", 0), (0, "attention")),
]


def _checkpoints(name: str, directory: Path) -> Path:
    if name == "dense":
        return DEMO_DENSE
    family = next(f for f in FAMILIES if f.name == name)

    def config(family=family):
        made = family.config()
        made.vocab_size = 512  # the demo run's token ids
        return made

    return save_family(dataclasses.replace(family, config=config), directory, seed=1)


def _changed(base: Path, name: str, change, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        change(name, model, torch.Generator().manual_seed(0))
    model.save_pretrained(directory)
    config = json.loads((base / "config.json").read_text())
    saved = json.loads((directory / "config.json").read_text())
    saved["model_type"] = config["model_type"]  # Kimi-K2's rewrite, kept
    (directory / "config.json").write_text(json.dumps(saved))
    return directory


@pytest.mark.parametrize(
    "name, change, where",
    [pytest.param(n, c, w, id=f"{n}-{w[1]}-{w[0]}", marks=() if n == "dense" else _newer(n)) for n, c, w in CASES],
)
def test_a_planted_fault_is_located(run, tmp_path, name, change, where):
    base = _checkpoints(name, tmp_path / "base")
    changed = _changed(base, name, change, tmp_path / "changed")
    result = probe("locate", run, "--a", f"hf:fp32:model={base}", "--b", f"hf:fp32:model={changed}", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    layer, op = where
    assert found["located"] == {"layer": layer, "op": op}, found["sentence"]
    rows = found["rows"]
    hit = next(r for r in rows if r["layer"] == layer and r["op"] == op)
    for earlier in rows[: rows.index(hit)]:  # nothing before it differs
        assert earlier["own"] == 0 and earlier["accumulated"] == 0, earlier
    if op == "router":
        assert (hit["own_flips"] >= 2) or (hit["own_scores"] > found["floors"]["router_scores"])
        assert next(r for r in rows if r["layer"] == layer and r["op"] == "mlp")["own"] == 0  # a's routes replayed
    else:
        assert 1e-5 < hit["own"] < 1e-2 and hit["own"] == hit["accumulated"]
    if name == "dense":
        assert not [r for r in rows if r["op"] == "router"]
    assert found["sentence"].startswith("the divergence starts in ")
