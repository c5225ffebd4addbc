"""`probe locate RUN` without --a and --b on a quantized hf rollout: side a is the rollout as it ran (its fp8 weight
quantization included), side b the matched set's configuration; equal default sides are refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from tests.conftest import DEMO_MOE, DEMO_PROMPTS

runner = CliRunner()
QUANT = "weight_quant=fp8-block128"


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    """A bf16 rollout with fp8 weights (hf), scored plain at bf16 (no role recorded) and at fp32 (larger k3)."""
    out = tmp_path_factory.mktemp("locate-defaults") / "run"
    common = ["--num-prompts", 2, "--samples-per-prompt", 1, "--max-new-tokens", 6, "--seed", 2]
    args = ["--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", out, "--dtype", "bf16", "--engine-arg", QUANT]
    result = probe("generate", *args, *common)
    assert result.exit_code == 0, result.output
    for dtype in ("bf16", "fp32"):
        result = probe("rescore", out, "--dtype", dtype)
        assert result.exit_code == 0, result.output
    return out


def test_side_a_is_the_rollout_as_it_ran_and_b_the_matched_set(quantized):
    model = json.loads((quantized / "manifest.json").read_text())["model"]
    result = probe("locate", quantized, "--worst", 1, "--samples", 0, "--json")
    assert result.exit_code == 0, result.output  # fp8 against bf16 weights: not bitwise, something to locate
    found = json.loads(result.output)
    assert found["a"] == f"hf:bf16:model={model},{QUANT}"
    # b: no set is marked matched, so the plain set at the rollout's dtype (not hf-fp32, of larger k3)
    assert found["b"] == f"hf:bf16:model={model}" and found["sequences"]["ranked_by"] == "hf-bf16"
    printed = " ".join(probe("locate", quantized, "--worst", 1, "--samples", 0).output.split())
    assert f"locate: a = hf:bf16:model={model},{QUANT}, b = hf:bf16:model={model};" in printed


def test_equal_default_sides_exit_2_with_one_line(quantized, tmp_path):
    run = Path(shutil.copytree(quantized, tmp_path / "run"))
    # the team trains on the rollout's fp8 weights: that set is the matched one, and equals the rollout's setup
    result = probe("rescore", run, "--dtype", "bf16", "--engine-arg", QUANT, "--name", "fp8", "--role", "matched")
    assert result.exit_code == 0, result.output
    assert json.loads((run / "scores" / "fp8" / "manifest.json").read_text())["role"] == "matched"
    page = run / "locate" / "index.html"  # the first test's page, copied
    before = page.stat().st_mtime_ns if page.is_file() else None
    result = probe("locate", run, "--worst", 1, "--samples", 0)
    assert result.exit_code == 2
    model = json.loads((run / "manifest.json").read_text())["model"]
    assert result.output.strip().splitlines() == [
        f"error: locate: a and b are the same configuration (hf:bf16:model={model},{QUANT}): nothing differs to "
        "locate; name another with --a or --b"
    ]
    assert (page.stat().st_mtime_ns if page.is_file() else None) == before  # nothing written
