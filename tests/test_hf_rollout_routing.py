"""`hf` generate stores routing for exactly the forwards a rollout needed: prompt_len + response_len - 1
positions per sample, as SGLang and vLLM return it, whatever else the batch holds.

A batched generate keeps forwarding a finished row (its EOS, then padding) while other rows still
generate; routing captured there belongs to no rollout. Greedy fp32 decoding gives the same tokens at
every batch size, so the routed positions must be the same too."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import DEMO_MOE, DEMO_PROMPTS
from typer.testing import CliRunner

from mismatch_probe.cli import app

pytestmark = pytest.mark.slow  # generate at three batch sizes on the demo model

runner = CliRunner()
MAX_NEW = 12
EOS = (0, 2)  # the demo model's generation_config.json


def _generate(tmp_path, batch_size: int) -> pl.DataFrame:
    run = tmp_path / f"batch-{batch_size}"
    args = [
        "generate",
        "--model",
        DEMO_MOE,
        "--prompts",
        DEMO_PROMPTS,
        "--out",
        run,
        "--num-prompts",
        16,
        "--temperature",
        0,
        "--max-new-tokens",
        MAX_NEW,
        "--dtype",
        "fp32",
        "--batch-size",
        batch_size,
    ]
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return pl.read_parquet(run / "rollout").sort("sample_id", "position")


def _per_sample(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.group_by("sample_id", maintain_order=True).agg(
        prompt_len=(~pl.col("is_response")).sum(),
        response_len=pl.col("is_response").sum(),
        last_token=pl.col("token_id").last(),
        routed=pl.col("experts").is_not_null().sum(),
        last_routed=pl.col("position").filter(pl.col("experts").is_not_null()).max(),
    )


def test_routing_rows_are_prompt_plus_response_minus_one_at_every_batch_size(tmp_path):
    frames = {size: _generate(tmp_path, size) for size in (1, 8, 64)}
    for size, frame in frames.items():
        samples = _per_sample(frame)
        finished = samples["last_token"].is_in(EOS) & (samples["response_len"] < MAX_NEW)
        # Samples that stop early beside samples that run on: the batch forwards finished rows.
        assert finished.sum() >= 3 and (~finished).sum() >= 3, samples
        expected = samples["prompt_len"] + samples["response_len"] - 1
        assert samples["routed"].to_list() == expected.to_list(), f"batch size {size}"
        assert samples["last_routed"].to_list() == (expected - 1).to_list()  # positions 0 .. n - 2, no gap
    reference = frames[1]
    for size in (8, 64):
        assert frames[size]["token_id"].to_list() == reference["token_id"].to_list()  # greedy: same rollouts
        np.testing.assert_array_equal(
            frames[size]["experts"].is_not_null().to_numpy(), reference["experts"].is_not_null().to_numpy()
        )
