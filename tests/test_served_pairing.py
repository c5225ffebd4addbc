"""A served (SGLang or vLLM) rollout whose manifest records a quantization gets the hf training pass matched to
its server's scheme (mismatch_probe/quant/served.py): in `probe report`'s missing lines, in `probe env RUN`,
and, once that pass is scored, a quant_share computed as for an hf rollout."""

from __future__ import annotations

import json
import shutil

import pytest
from naive_metrics import read_side, sequence_deltas
from test_attribution import _k3
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.serving.quantization import served_quantization
from mismatch_probe.quant.served import is_matched, matched_quant_args
from mismatch_probe.report.build import build_report

SERVED_FP8 = {"weight": "fp8", "act": None, "kv": None, "quantized_modules": None, "skipped_modules": None}
ONLINE = {"weight_quant": "fp8-tensor", "act_quant": "fp8-tensor"}
BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _ok(result):
    assert result.exit_code == 0, result.output
    return result


def fp8_checkpoint(tmp_path, model, quantization_config):
    """A model folder whose config.json names an FP8 checkpoint (only the config is read by the mapping)."""
    folder = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return folder


def test_the_mapping_of_each_served_scheme(tmp_path, tiny_dense):
    block = fp8_checkpoint(tmp_path, tiny_dense, BLOCK)
    tensor = fp8_checkpoint(tmp_path, tiny_dense, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    other = fp8_checkpoint(tmp_path, tiny_dense, {"quant_method": "compressed-tensors"})
    assert matched_quant_args(SERVED_FP8, tiny_dense) == ONLINE  # online fp8 on a bf16 checkpoint
    assert matched_quant_args(SERVED_FP8, block) == {"weight_quant": f"checkpoint:{block}"}
    assert matched_quant_args(SERVED_FP8, str(tensor)) == {"weight_quant": f"checkpoint:{tensor}"}
    assert matched_quant_args(SERVED_FP8 | {"kv": "fp8_e4m3"}, tiny_dense) == ONLINE | {"kv_quant": "fp8"}
    assert matched_quant_args(SERVED_FP8 | {"weight": None, "kv": "fp8"}, tiny_dense) == {"kv_quant": "fp8"}
    for unknown, model in (
        (SERVED_FP8, other),  # an fp8 server on a checkpoint quantized some other way
        (SERVED_FP8, tmp_path / "absent"),  # no config.json to tell online from checkpoint
        (SERVED_FP8 | {"weight": "modelopt_fp4"}, tiny_dense),
        (SERVED_FP8 | {"weight": "mxfp8"}, tiny_dense),
        (SERVED_FP8 | {"kv": "fp8_e5m2"}, tiny_dense),
    ):
        assert matched_quant_args(unknown, model) is None, unknown
    hf = {"weight": "fp8-block128", "act": "fp8-token128", "kv": "fp8", "quantized_modules": [], "skipped_modules": []}
    expected = {"weight_quant": "fp8-block128", "act_quant": "fp8-token128", "kv_quant": "fp8"}
    assert matched_quant_args(hf, None) == expected  # an hf rollout names hf schemes already
    assert matched_quant_args(None, tiny_dense) is None
    assert matched_quant_args(SERVED_FP8 | {"weight": None}, tiny_dense) is None  # nothing quantized
    assert is_matched(("checkpoint:/elsewhere/model", "fp8-token128"), (f"checkpoint:{block}", None))
    assert not is_matched(("fp8-tensor", "fp8-tensor"), (f"checkpoint:{block}", None))
    assert not is_matched(("fp8-tensor", None), ("fp8-tensor", "fp8-tensor"))


def test_a_server_that_names_no_scheme_runs_the_checkpoints_own(tmp_path, tiny_dense):
    """SGLang serves an FP8 checkpoint started without --quantization with `quantization: null` in its
    server_info: the manifest then names the checkpoint's quant_method, and the pass is read from it."""
    block = fp8_checkpoint(tmp_path, tiny_dense, BLOCK)
    entry = served_quantization(None, "auto", block)
    assert entry == SERVED_FP8
    assert matched_quant_args(entry, block) == {"weight_quant": f"checkpoint:{block}"}
    assert served_quantization(None, "auto", tiny_dense) is None  # a bf16 checkpoint: nothing quantized
    assert served_quantization(None, "fp8_e4m3", tmp_path / "absent") == SERVED_FP8 | {"weight": None, "kv": "fp8_e4m3"}
    assert served_quantization("fp8", None, tiny_dense) == SERVED_FP8  # what the server names comes first


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_dense):
    """An hf bf16 rollout of the tiny model recorded as an SGLang server's `--quantization fp8`, with a plain fp32
    training set; the matched set comes later."""
    root = tmp_path_factory.mktemp("served")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) + "\n" for i in range(8)))
    run = root / "run"
    _ok(probe("generate", "--model", tiny_dense, "--prompts", prompts, "--out", run, "--dtype", "bf16",
              "--max-new-tokens", 12, "--seed", 3, "--engine-arg", "weight_quant=fp8-tensor"))  # fmt: skip
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["engine"]["engine"] = "sglang"
    (run / "manifest.json").write_text(json.dumps(manifest | {"quantization": SERVED_FP8}))
    _ok(probe("rescore", run, "--dtype", "fp32", "--name", "plain"))
    return run


def test_a_served_fp8_rollout_is_told_its_matched_pass(served):
    missing = build_report(served, render=False).metrics["attribution"]["missing"]
    [line] = [m for m in missing if "weight_quant" in m]
    assert "--engine hf --dtype bf16 --engine-arg weight_quant=fp8-tensor --engine-arg act_quant=fp8-tensor " in line
    assert "weight quantization (fp8) explains" in line
    found = json.loads(_ok(probe("env", served, "--json")).output)
    rollout = found["run"]["sides"][0]
    assert (
        rollout["matched_pass"] == "--engine hf --engine-arg weight_quant=fp8-tensor --engine-arg act_quant=fp8-tensor"
    )
    assert [s["matched_pass"] for s in found["run"]["sides"][1:]] == [None]
    text = _ok(CliRunner().invoke(app, ["env", str(served)], env={"COLUMNS": "400"})).output
    assert f"matched training pass: probe rescore {served} --engine hf --engine-arg weight_quant=fp8-tensor" in text


def test_a_served_scheme_without_a_matched_pass_says_so(served, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(served, run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"quantization": SERVED_FP8 | {"weight": "modelopt_fp4"}}))
    missing = build_report(run, render=False).metrics["attribution"]["missing"]
    assert not [m for m in missing if "weight_quant" in m]  # never a pass the hf engine refuses
    [line] = [m for m in missing if m.startswith("quant_share:")]
    assert "no matched hf training pass is known for the served quantization (weight modelopt_fp4)" in line
    found = json.loads(_ok(probe("env", run, "--json")).output)
    assert found["run"]["sides"][0]["matched_pass"].startswith("no matched hf training pass")


@pytest.mark.slow
def test_the_matched_pass_gives_a_quant_share(served, tmp_path, tiny_dense):
    """~4 s. The matched set scored with the mapped pair; where act_quant=fp8-tensor is not built yet, the set
    is scored with its weight scheme and its manifest labelled as the pair (the share then still pairs them)."""
    from mismatch_probe.quant.schemes import ACT_SCHEMES

    run = tmp_path / "run"
    shutil.copytree(served, run)
    if "fp8-tensor" in ACT_SCHEMES:
        args = [a for key, value in ONLINE.items() for a in ("--engine-arg", f"{key}={value}")]
        _ok(probe("rescore", run, "--dtype", "fp32", "--name", "matched", *args))
    else:
        _ok(probe("rescore", run, "--dtype", "fp32", "--name", "matched", "--engine-arg", "weight_quant=fp8-tensor"))
        path = run / "scores" / "matched" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["quantization"]["act"] = "fp8-tensor"
        path.write_text(json.dumps(manifest))
    _ok(probe("report", run))
    attribution = json.loads((run / "report" / "metrics.json").read_text())["attribution"]
    [entry] = attribution["quant_share"]
    assert (entry["plain"], entry["matched"], entry["weight"], entry["act"]) == (
        "scores/plain",
        "scores/matched",
        "fp8",
        None,
    )
    rollout = read_side(run / "rollout")
    without = sequence_deltas(rollout, read_side(run / "scores" / "plain"))
    with_fix = sequence_deltas(rollout, read_side(run / "scores" / "matched"))
    assert entry["share"] == pytest.approx(1 - _k3(with_fix) / _k3(without), rel=1e-9)
    assert not [m for m in attribution["missing"] if "weight_quant" in m]

    # the same rollout served from an FP8 checkpoint: a training set read from a checkpoint is its matched pass
    checkpoint = fp8_checkpoint(tmp_path, tiny_dense, BLOCK)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"model": str(checkpoint)}))
    missing = build_report(run, pairs=["rollout:scores/plain"], render=False).metrics["attribution"]["missing"]
    [line] = [m for m in missing if "weight_quant" in m]
    assert f"--engine-arg weight_quant=checkpoint:{checkpoint} --name" in line
    path = run / "scores" / "matched" / "manifest.json"
    scored = json.loads(path.read_text())
    scored["quantization"] |= {"weight": f"checkpoint:{tiny_dense}", "act": "fp8-token128"}
    path.write_text(json.dumps(scored))
    both = ["rollout:scores/plain", "rollout:scores/matched"]  # the report above remembered its one pair
    [entry] = build_report(run, pairs=both, render=False).metrics["attribution"]["quant_share"]
    assert entry["matched"] == "scores/matched"
