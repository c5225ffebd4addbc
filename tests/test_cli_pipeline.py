"""`probe generate` and `probe rescore` end to end on tiny local models, through the CLI."""

from __future__ import annotations

import json

import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()


def probe(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"input_ids": [3 + i, 4 + i, 5 + i, 6 + (i % 3)][: 2 + i % 3]} for i in range(5)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, tiny_moe, prompts):
    run = tmp_path_factory.mktemp("runs") / "moe"
    result = probe(
        "generate",
        "--model",
        tiny_moe,
        "--prompts",
        prompts,
        "--out",
        run,
        "--samples-per-prompt",
        2,
        "--max-new-tokens",
        6,
        "--batch-size",
        4,
        "--seed",
        7,
    )
    assert result.exit_code == 0, result.output
    for extra in (
        ["--dtype", "fp32"],
        ["--dtype", "bf16", "--replay", "r3"],
        ["--dtype", "bf16", "--repeats", "2", "--vary-batching", "--batch-size", "3"],
    ):
        result = probe("rescore", run, *extra)
        assert result.exit_code == 0, result.output
    return run


def test_run_layout_and_alignment(moe_run):
    manifest = json.loads((moe_run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["num_samples"] == 10
    assert manifest["moe_layer_indices"] == [0, 2] and manifest["num_layers"] == 2 and manifest["top_k"] == 2
    rollout = pl.read_parquet(moe_run / "rollout")
    assert rollout["sample_id"].unique().sort().to_list() == list(range(10))
    keys = rollout.select("sample_id", "position")
    assert keys.equals(keys.sort("sample_id", "position"))
    sets = sorted(p.name for p in (moe_run / "scores").iterdir())
    assert sets == ["hf-bf16-pass1", "hf-bf16-pass2", "hf-bf16-r3", "hf-fp32"]
    for name in sets:
        side = pl.read_parquet(moe_run / "scores" / name / "*.parquet")
        assert side.select("sample_id", "position", "token_id").equals(
            rollout.select("sample_id", "position", "token_id")
        )
        meta = json.loads((moe_run / "scores" / name / "manifest.json").read_text())
        assert meta["status"] == "complete" and meta["temperature"] == 1.0
    pass2 = json.loads((moe_run / "scores" / "hf-bf16-pass2" / "manifest.json").read_text())
    assert pass2["repeat_group"] == "hf-bf16" and pass2["pass_index"] == 2
    assert pass2["batch_layout"] == {"micro_batch": 1, "shuffle_seed": 2, "extra_padding": 5}


def test_r3_reproduces_rollout_routing(moe_run):
    rollout = pl.read_parquet(moe_run / "rollout")
    r3 = pl.read_parquet(moe_run / "scores" / "hf-bf16-r3" / "*.parquet")
    have = rollout["experts"].is_not_null().to_numpy()
    assert have.sum() == len(rollout) - 10  # one unforwarded last token per sample
    assert rollout["experts"].filter(pl.Series(have)).to_list() == r3["experts"].filter(pl.Series(have)).to_list()


def test_refuses_to_clobber_and_resumes(moe_run, tiny_moe, prompts, tmp_path):
    result = probe("generate", "--model", tiny_moe, "--prompts", prompts, "--out", moe_run)
    assert result.exit_code == 2
    assert "already exists; pass --resume to continue it or --overwrite to replace it" in result.output

    run = tmp_path / "copy"
    args = [
        "generate",
        "--model",
        tiny_moe,
        "--prompts",
        prompts,
        "--out",
        run,
        "--samples-per-prompt",
        2,
        "--max-new-tokens",
        6,
        "--batch-size",
        4,
        "--seed",
        7,
    ]
    assert probe(*args).exit_code == 0
    whole = pl.read_parquet(run / "rollout")
    assert whole.equals(pl.read_parquet(moe_run / "rollout"))  # same seed, same rollout
    (run / "rollout" / "part-0000000004.parquet").unlink()  # as if killed before this part finished
    result = probe(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(run / "rollout").equals(whole)


def test_bad_inputs_exit_2(moe_run, tiny_dense, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    result = probe("generate", "--model", tiny_dense, "--prompts", bad, "--out", tmp_path / "x")
    assert result.exit_code == 2
    assert "bad.jsonl:1: expected a 'prompt' string, 'messages' or 'input_ids'" in result.output
    result = probe("rescore", moe_run, "--model", tiny_dense)
    assert result.exit_code == 2 and "moe_layer_indices is [0, 2], but the model at" in result.output
    result = probe("rescore", tmp_path / "nope")
    assert result.exit_code == 2 and "run directory not found" in result.output
    assert "Traceback" not in result.output
