"""`probe locate` (issue 42): known answers on copies of the demo MoE model with one operation changed, the exit
codes, the defaults from the run's manifests, the SPEC errors and the --json schema.

One small run of the demo MoE model (4 prompts, 8 new tokens, hf bf16 rollout, hf fp32 score set) serves every
test; each locate scores 8 sequences, a few seconds on a CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEMO_MOE, DEMO_PROMPTS
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.locate.ops import OPS

runner = CliRunner()
LAYERS = 4  # the demo MoE model: 4 layers, every one MoE


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("locate") / "run"
    common = ["--num-prompts", 4, "--samples-per-prompt", 2, "--max-new-tokens", 8, "--seed", 3]
    result = probe("generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", out, "--dtype", "bf16", *common)
    assert result.exit_code == 0, result.output
    result = probe("rescore", out, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    return out


def changed_copy(directory: Path, change) -> Path:
    """The demo MoE model saved to `directory` after `change(model, generator)` edited its weights in place."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MOE, dtype=torch.float32)
    with torch.no_grad():
        change(model, torch.Generator().manual_seed(0))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (DEMO_MOE / name).is_file() and not (directory / name).is_file():
            shutil.copy(DEMO_MOE / name, directory / name)
    return directory


def perturb(weight: torch.Tensor, relative: float, generator: torch.Generator) -> None:
    """weight += noise with ‖noise‖ = relative · ‖weight‖."""
    noise = torch.randn(weight.shape, generator=generator)
    weight += relative * weight.norm() / noise.norm() * noise


def locate_json(run: Path, *args) -> tuple[int, dict]:
    result = probe("locate", run, *args, "--json")
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.output)


def row(found: dict, layer, op: str) -> dict:
    return next(r for r in found["rows"] if r["layer"] == layer and r["op"] == op)


def assert_starts_at(found: dict, layer, op: str) -> None:
    """Located there, and there exactly: every row before it agrees bitwise (own and accumulated), and the
    row's own error is its accumulated error (nothing came from below)."""
    assert found["located"] == {"layer": layer, "op": op}, found["sentence"]
    index = found["rows"].index(row(found, layer, op))
    for earlier in found["rows"][:index]:
        assert earlier["own"] == 0 and earlier["accumulated"] == 0, earlier
    hit = found["rows"][index]
    assert hit["own"] > 0 and hit["accumulated"] == hit["own"]
    others = [
        r["own"]
        for r in found["rows"]
        if r is not hit and r["op"] != "block" and (r["op"] == "router") == (op == "router")
    ]
    assert max(others) * 10 <= hit["own"]


def test_attention_projection_perturbed_is_located(run, tmp_path):
    model = changed_copy(tmp_path / "m", lambda m, g: perturb(m.model.layers[2].self_attn.v_proj.weight, 1e-3, g))
    code, found = locate_json(run, "--a", "hf:fp32", "--b", f"hf:fp32:model={model}")
    assert code == 0
    assert_starts_at(found, 2, "attention")
    assert 1e-4 < row(found, 2, "attention")["own"] < 1e-2
    assert row(found, None, "logits")["accumulated"] > 0 and row(found, None, "logits")["own"] == 0
    assert found["sentence"].startswith("the divergence starts in layer 2's attention: own relative error ")


def test_one_layers_experts_in_bf16_are_located_at_its_mlp(run, tmp_path):
    def round_experts(model, generator):
        experts = model.model.layers[1].mlp.experts
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(weight.to(torch.bfloat16).float())

    model = changed_copy(tmp_path / "m", round_experts)
    code, found = locate_json(run, "--a", "hf:fp32", "--b", f"hf:fp32:model={model}")
    assert code == 0
    assert_starts_at(found, 1, "mlp")
    assert row(found, 1, "router")["own"] == 0  # b's router on a's input: the same weights, the same experts


def test_router_only_perturbation_is_located_at_the_router_with_its_flips(run, tmp_path):
    model = changed_copy(tmp_path / "m", lambda m, g: perturb(m.model.layers[2].mlp.gate.weight, 0.3, g))
    code, found = locate_json(run, "--a", "hf:fp32", "--b", f"hf:fp32:model={model}")
    assert code == 0
    assert_starts_at(found, 2, "router")
    router = row(found, 2, "router")
    assert router["own_flips"] >= 2 and router["tokens"] == found["tokens"]
    assert router["own"] == router["own_flips"] / router["tokens"]
    assert row(found, 2, "mlp")["own"] == 0  # a's routes replayed: the experts themselves are unchanged
    assert f"{router['own_flips']} of {router['tokens']} tokens choose other experts" in found["sentence"]


def test_the_same_configuration_agrees_bitwise_exit_1(run):
    result = probe("locate", run, "--a", "hf:fp32", "--b", "hf:fp32")
    assert result.exit_code == 1, result.output
    assert "agree bitwise on these sequences: nothing to locate" in result.output
    code, found = locate_json(run, "--a", "hf:fp32", "--b", "hf:fp32")
    assert code == 1 and found["bitwise_equal"] and found["located"] is None


def test_bf16_against_fp32_grows_with_depth_and_names_the_largest_own_error(run):
    result = probe("locate", run, "--a", "hf:bf16", "--b", "hf:fp32", "--worst", 2, "--samples", 2)
    assert result.exit_code == 0, result.output
    code, found = locate_json(run, "--a", "hf:bf16", "--b", "hf:fp32", "--worst", 2, "--samples", 2)
    assert row(found, LAYERS - 1, "block")["accumulated"] > row(found, 0, "block")["accumulated"]
    largest = found["largest_own"]
    named = (
        "the logits"
        if largest["op"] == "logits"
        else "the final norm"
        if largest["layer"] is None
        else f"layer {largest['layer']}'s {largest['op']}"
    )
    assert named in " ".join(result.output.split())  # the table wraps on narrow terminals
    if found["located"] is None:
        assert "no single operation stands out: the error grows evenly" in found["sentence"]


def test_float32_kernels_alone_stand_out_nowhere(run):
    """hf fp32 with eager attention against sdpa: differences at float32 rounding only, under every floor."""
    code, found = locate_json(
        run, "--a", "hf:fp32:attn_implementation=eager", "--b", "hf:fp32:attn_implementation=sdpa"
    )
    assert found["located"] is None
    for r in found["rows"]:
        if r["op"] != "router":
            assert r["own"] < found["floors"][r["op"]], r


@pytest.mark.slow
def test_megatron_fp32_against_hf_fp32_stands_out_nowhere(run):
    """The same weights in megatron-core and in transformers, both float32: layers matched by index and op,
    every own error under its float32 floor, routers at most one near-tie flip, and the comparison ran (exit 0)."""
    code, found = locate_json(run, "--a", "hf:fp32", "--b", "megatron:fp32", "--worst", 2, "--samples", 2)
    assert code == 0 and not found["bitwise_equal"], found["sentence"]
    assert found["located"] is None, found["sentence"]
    assert "no single operation stands out" in found["sentence"]
    assert len(found["rows"]) == LAYERS * 4 + 2
    for r in found["rows"]:
        if r["op"] == "router":
            assert r["own_flips"] <= 1 and r["accumulated_flips"] <= 1, r
        else:
            assert r["own"] < found["floors"][r["op"]], r
            assert r["accumulated"] < 1e-5, r


@pytest.mark.slow
def test_a_fault_in_megatrons_checkpoint_is_located_across_engines(run, tmp_path):
    """b = megatron on a copy with layer 2's v_proj perturbed, a = hf on the original: own across engines feeds
    hf's captured inputs into megatron's modules, so layer 2's attention stands out and nothing before it does."""
    model = changed_copy(tmp_path / "m", lambda m, g: perturb(m.model.layers[2].self_attn.v_proj.weight, 1e-3, g))
    code, found = locate_json(
        run, "--a", "hf:fp32", "--b", f"megatron:fp32:model={model}", "--worst", 2, "--samples", 2
    )
    assert code == 0
    assert found["located"] == {"layer": 2, "op": "attention"}, found["sentence"]
    hit = row(found, 2, "attention")
    assert 1e-4 < hit["own"] < 1e-2 and abs(hit["accumulated"] - hit["own"]) < 0.01 * hit["own"]
    for r in found["rows"][: found["rows"].index(hit)]:
        assert r["own"] < found["floors"].get(r["op"], 1) and r.get("own_flips", 0) <= 1, r


def test_defaults_come_from_the_manifests_and_json_schema(run):
    code, found = locate_json(run, "--worst", 1, "--samples", 1)
    assert code == 0
    model = json.loads((run / "manifest.json").read_text())["model"]
    assert found["a"] == f"hf:bf16:model={model}" and found["b"] == f"hf:fp32:model={model}"
    assert found["stand_ins"] == []
    assert found["sequences"]["ranked_by"] == "hf-fp32"
    assert len(found["sequences"]["worst"]) == 1 and len(found["sequences"]["sampled"]) == 1
    assert set(found) >= {"located", "rows", "sentence", "floors", "tokens", "bitwise_equal"}
    assert found["located"] is None or set(found["located"]) == {"layer", "op"}
    rows = found["rows"]
    assert len(rows) == LAYERS * 4 + 2
    assert [(r["layer"], r["op"]) for r in rows[-2:]] == [(None, "final_norm"), (None, "logits")]
    assert [r["op"] for r in rows[:4]] == ["attention", "router", "mlp", "block"]
    for r in rows:
        assert r["op"] in OPS and {"layer", "op", "own", "accumulated"} <= set(r)
        assert (r["layer"] is None) == (r["op"] in ("final_norm", "logits"))
    assert (run / "locate" / "index.html").read_text().count("<svg") == 1


def test_the_worst_sequences_are_those_of_largest_k3(run):
    from mismatch_probe.locate.choose import choose, largest, training_sets
    from mismatch_probe.rundir.layout import Run

    ranked = largest(training_sets(Run(run)))
    choice = choose(Run(run), ranked, worst=3, samples=2)
    by_k3 = dict(zip(ranked.sample_ids.tolist(), ranked.sequence_k3.tolist()))
    assert sorted(by_k3.values(), reverse=True)[:3] == [by_k3[i] for i in choice.worst]
    assert not set(choice.worst) & set(choice.sampled)
    assert choose(Run(run), ranked, worst=3, samples=2) == choice  # the draw has a fixed seed


def test_a_megatron_training_set_is_located_as_megatron(run, tmp_path):
    from mismatch_probe.locate.defaults import resolve
    from mismatch_probe.rundir.layout import Run

    copy = Path(shutil.copytree(run, tmp_path / "run"))
    path = copy / "scores" / "hf-fp32" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["engine"] = {"engine": "megatron", "dtype": "fp32"}
    path.write_text(json.dumps(manifest))
    sides = resolve(Run(copy), None, None, "hf-fp32")
    assert (sides.b.engine, sides.b.dtype) == ("megatron", "fp32") and sides.notes == []


def test_a_server_rollout_is_stood_in_for_by_hf(run, tmp_path):
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engine"] = {"engine": "sglang", "dtype": "bf16"}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = probe("locate", copy, "--b", "hf:fp32", "--worst", 1, "--samples", 0)
    assert result.exit_code == 0, result.output
    line = "--a: the rollout ran sglang, which gives probe no hooks: hf:bf16 stands in for it"
    assert line in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "hf",
            "--a: 'hf' is not ENGINE:DTYPE[:KEY=VALUE,...], e.g. hf:fp32 or hf:bf16:model=ckpt/,attn_implementation=eager",
        ),
        ("jax:fp32", "--a: engine 'jax' is not one of hf, megatron"),
        ("hf:fp64", "--a: dtype 'fp64' is not one of bf16, fp16, fp32, fp32-bf16w"),
        (
            "hf:fp32:lm_head=fp32",
            "--a: --engine-arg lm_head: unknown key for --engine hf (valid keys: logprob_chunk, device, device_map, "
            "weight_quant, weight_quant_skip, act_quant, kv_quant, quant_compute, attn_implementation, lm_head_dtype, "
            "router_dtype); "
            "locate's own keys: model",
        ),
        ("hf:fp32:router_dtype=fp16", "--a: --engine-arg router_dtype=fp16: expected one of none, fp32"),
        (
            "hf:fp32:weight_quant=fp9",
            "--a: --engine-arg weight_quant=fp9: expected one of none, fp8-block128, fp8-channel, fp8-tensor, mxfp8, "
            "nvfp4, int4-g128",
        ),
        (
            "hf:fp32:act_quant=fp4",
            "--a: --engine-arg act_quant=fp4: expected one of none, fp8-token128, fp8-token, fp8-tensor",
        ),
        (
            "hf:fp32:logprob_chunk=64",
            "--a: key 'logprob_chunk' does not apply to locate (locate takes the logits at the chosen positions, "
            "not chunked log-probs)",
        ),
        (
            "megatron:fp32:tensor_parallel=2",
            "--a: tensor_parallel=2: locate runs megatron in one process, tensor_parallel=1 only",
        ),
        (
            "megatron:fp32:weight_quant=fp8-block128",
            "--a: --engine-arg weight_quant: unknown key for --engine megatron (valid keys: logprob_chunk, "
            "tensor_parallel, expert_parallel, config_file, override_transformer_config.FIELD); locate's own "
            "keys: model",
        ),
        ("hf:fp32:model", "--a: 'model' is not KEY=VALUE"),
        ("hf:fp32:model=a,model=b", "--a: key 'model' given twice"),
        ("hf:fp32:model=", "--a: key 'model' has no value"),
        (
            "megatron:bf16:attn_implementation=eager",
            "--a: key 'attn_implementation' applies to hf only; megatron takes model=PATH",
        ),
    ],
)
def test_bad_specs_exit_2_with_one_line(tmp_path, spec, message):
    result = probe("locate", tmp_path / "no-such-run", "--a", spec, "--b", "hf:fp32")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], result.output
    assert "Traceback" not in result.output


def test_a_folder_without_a_model_is_refused(run, tmp_path):
    from mismatch_probe.errors import ProbeError
    from mismatch_probe.locate.job import LocateJob, run_locate

    with pytest.raises(ProbeError, match="not a model folder"):
        run_locate(LocateJob(run=run, a="hf:fp32", b=f"hf:fp32:model={tmp_path}", quiet=True))


def test_the_report_links_the_page_and_overwrite_knows_it(run):
    from mismatch_probe.rundir.layout import RUN_LAYOUT
    from mismatch_probe.rundir.ownership import foreign_entry

    code, _ = locate_json(run, "--a", "hf:fp32", "--b", "hf:fp32", "--worst", 1, "--samples", 0)
    assert code == 1 and (run / "locate" / "index.html").is_file()
    assert foreign_entry(run, RUN_LAYOUT) is None  # probe's own page: `generate --overwrite` may replace the run
    result = probe("report", run)
    assert result.exit_code == 0, result.output
    assert 'href="../locate/index.html"' in (run / "report" / "index.html").read_text()


def test_fake_quantized_weights_show_in_every_projection_and_not_in_the_routers(run):
    """b = the hf training engine's weight_quant=fp8-block128: every attention and mlp of every layer has own error
    above its floor (each projection is quantized); the routers are skipped by default, so b's router on a's input
    is a's router: no flip and no score difference of its own."""
    common = ("--worst", 2, "--samples", 2)
    code, found = locate_json(run, "--a", "hf:fp32", "--b", "hf:fp32:weight_quant=fp8-block128", *common)
    assert code == 0, found["sentence"]
    assert found["b"].startswith("hf:fp32:model=") and found["b"].endswith(",weight_quant=fp8-block128")
    for layer in range(LAYERS):
        for op in ("attention", "mlp"):
            assert row(found, layer, op)["own"] > found["floors"][op], row(found, layer, op)
        router = row(found, layer, "router")
        assert router["own"] == 0 and router["own_scores"] == 0, router
    code, skipless = locate_json(
        run, "--a", "hf:fp32", "--b", "hf:fp32:weight_quant=fp8-block128,weight_quant_skip=", *common
    )
    assert code == 0, skipless["sentence"]
    for layer in range(LAYERS):  # routers quantized too: their scores move on the same input
        assert row(skipless, layer, "router")["own_scores"] > 0, row(skipless, layer, "router")
        for op in ("attention", "mlp"):  # the experts' own pass replays a's routes: the same rows as before
            assert row(skipless, layer, op)["own"] == row(found, layer, op)["own"]


def test_act_quant_hooks_are_applied_as_the_engine_applies_them(run):
    common = ("--worst", 1, "--samples", 0)
    _, weights = locate_json(run, "--a", "hf:fp32", "--b", "hf:fp32:weight_quant=fp8-block128", *common)
    _, both = locate_json(
        run, "--a", "hf:fp32", "--b", "hf:fp32:weight_quant=fp8-block128,act_quant=fp8-token128", *common
    )
    for layer in range(LAYERS):
        assert row(both, layer, "attention")["own"] > row(weights, layer, "attention")["own"]


def test_the_hf_knobs_reach_locate(run):
    """A configuration's knobs are the engine's own options, applied where the engine loads the model: the fp32
    LM head changes the logits alone, and the fp32 routers every router's scores and nothing else."""
    _, found = locate_json(run, "--a", "hf:bf16", "--b", "hf:bf16:lm_head_dtype=fp32")
    assert found["b"].endswith(",lm_head_dtype=fp32")
    assert_starts_at(found, None, "logits")
    _, found = locate_json(run, "--a", "hf:bf16", "--b", "hf:bf16:router_dtype=fp32")
    routers = [r for r in found["rows"] if r["op"] == "router"]
    assert routers and all(r["own_scores"] > found["floors"]["router_scores"] for r in routers)
    assert all(r["own"] == 0 for r in found["rows"] if r["op"] not in ("router", "block"))
