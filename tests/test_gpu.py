"""The GPU lane: real engines on CUDA, end to end through the CLI (run by scripts/gpu_check.sh on a GPU box).

Skipped where torch sees no CUDA device. `PROBE_GPU_TESTS_ON_CPU=1` runs the same checks on the CPU, to test
the tests themselves on a machine without a GPU (megatron's equality bound then holds trivially tighter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.pipeline.demo.run import DATA
from mismatch_probe.schema import RoutingShape, experts_matrix

ON_CPU = os.environ.get("PROBE_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="torch sees no CUDA device"),
]
MOE = DATA / "models" / "moe"
PROMPTS = DATA / "prompts" / "demo.jsonl"
NUM_PROMPTS = 16


def probe(*args: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One bf16 rollout on the GPU, rescored by hf and megatron in fp32, bf16, R3 and repeated passes."""
    # megatron fp32 against hf fp32 to 1e-6 needs exact fp32 matrix products on both sides.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("gpu") / "run"
    device = f"device={DEVICE}"
    probe("generate", "--model", MOE, "--prompts", PROMPTS, "--out", root, "--engine", "hf", "--engine-arg", device,
          "--num-prompts", NUM_PROMPTS, "--max-new-tokens", 32, "--dtype", "bf16", "--batch-size", 8)  # fmt: skip
    hf = ("--engine", "hf", "--engine-arg", device)
    probe("rescore", root, *hf, "--dtype", "fp32")
    probe("rescore", root, *hf, "--dtype", "bf16")
    probe("rescore", root, *hf, "--dtype", "bf16", "--replay", "r3")
    probe("rescore", root, *hf, "--dtype", "bf16", "--repeats", 2, "--vary-batching", "--name", "hf-bf16-rep")
    probe("rescore", root, "--engine", "megatron", "--dtype", "fp32")
    probe("rescore", root, "--engine", "megatron", "--dtype", "bf16")
    probe("rescore", root, "--engine", "megatron", "--dtype", "bf16", "--replay", "r3")
    probe("report", root)
    return root


def _side(root: Path, side: str) -> dict:
    folder = root / side
    table = pa.concat_tables([pq.read_table(part) for part in sorted(folder.glob("part-*.parquet"))])
    manifest = json.loads((root / "manifest.json").read_text())
    shape = RoutingShape(manifest["num_layers"], manifest["top_k"], manifest["num_experts"])
    experts, valid = experts_matrix(table.column("experts"), shape, str(folder))
    logprob = table.column("logprob").to_numpy(zero_copy_only=False)
    return {"logprob": logprob, "response": table.column("is_response").to_numpy(zero_copy_only=False),
            "experts": experts, "valid": valid}  # fmt: skip


def _k3(a: dict, b: dict) -> float:
    d = (b["logprob"].astype(np.float64) - a["logprob"])[a["response"]]
    return float(np.mean(np.expm1(d) - d))


def _metrics(root: Path) -> dict[tuple[str, str], dict]:
    comparisons = json.loads((root / "report" / "metrics.json").read_text())["comparisons"]
    return {(c["reference"], c["candidate"]): c["metrics"] for c in comparisons}


def test_every_side_ran_on_the_device(run):
    manifest = json.loads((run / "manifest.json").read_text())
    assert DEVICE in json.dumps(manifest["engine"]), manifest["engine"]
    for name in ("hf-fp32", "hf-bf16", "hf-bf16-r3", "hf-bf16-rep-pass1", "hf-bf16-rep-pass2"):
        score = json.loads((run / "scores" / name / "manifest.json").read_text())
        assert DEVICE in json.dumps(score), name
    for name in ("megatron-fp32", "megatron-bf16", "megatron-bf16-r3"):
        assert (run / "scores" / name / "manifest.json").is_file()


def test_megatron_fp32_equals_hf_fp32(run):
    hf, megatron = _side(run, "scores/hf-fp32"), _side(run, "scores/megatron-fp32")
    assert np.isfinite(hf["logprob"][hf["response"]]).all()
    assert _k3(hf, megatron) < 1e-6
    assert np.abs(hf["logprob"] - megatron["logprob"])[hf["response"]].max() < 1e-3


@pytest.mark.parametrize("r3", ["hf-bf16-r3", "megatron-bf16-r3"])
def test_r3_replays_the_rollout_routes_and_cuts_k3(run, r3):
    rollout, replayed = _side(run, "rollout"), _side(run, f"scores/{r3}")
    both = rollout["valid"] & replayed["valid"]
    assert both.sum() > 100
    np.testing.assert_array_equal(np.sort(rollout["experts"][both], -1), np.sort(replayed["experts"][both], -1))
    plain = r3.removesuffix("-r3")
    # On a GPU hf bf16 often routes as the bf16 rollout did already: R3 can only keep k3 or cut it.
    assert _k3(rollout, replayed) <= _k3(rollout, _side(run, f"scores/{plain}"))


def test_bf16_is_measurably_not_fp32_and_passes_are_finite(run):
    rollout = _side(run, "rollout")
    assert _k3(rollout, _side(run, "scores/hf-bf16")) > 0
    one, two = _side(run, "scores/hf-bf16-rep-pass1"), _side(run, "scores/hf-bf16-rep-pass2")
    assert np.isfinite(one["logprob"][one["response"]]).all() and np.isfinite(two["logprob"][two["response"]]).all()
    assert _k3(one, two) < 1e-3  # batch non-invariance is small, where it shows at all
    metrics = _metrics(run)
    assert metrics[("rollout", "scores/hf-bf16")]["k3_kl"] == pytest.approx(
        _k3(rollout, _side(run, "scores/hf-bf16")), rel=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorder_takes_device_tensors(tmp_path, dtype):
    from mismatch_probe.record import Recorder

    rng = torch.Generator().manual_seed(0)
    with Recorder(tmp_path / "run", num_experts=8) as rec:
        for step in range(4):
            prompt = torch.randint(0, 100, (5,), generator=rng).to(DEVICE)
            response = torch.randint(0, 100, (7,), generator=rng).to(DEVICE)
            inference = (-torch.rand(7, generator=rng)).to(DEVICE, dtype)
            training = inference + (0.01 * torch.randn(7, generator=rng)).to(DEVICE, dtype)
            experts = torch.randint(0, 8, (12, 2, 2), generator=rng).to(DEVICE)
            rec.add(prompt, response, inference, training, routed_experts=experts, step=step)
    probe("report", tmp_path / "run")
    [metrics] = _metrics(tmp_path / "run").values()
    assert metrics["k3_kl"] > 0 and metrics["n_tokens"] == 28


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory) -> Path:
    """A rollout on the GPU, its θ_old passes with router log-probs, and a router-perturbed checkpoint scored
    natural, R2 and R3 on CUDA, plus R2 at the rollout's own checkpoint (docs/staleness.md)."""
    from policy_runs import router_perturbed

    root = tmp_path_factory.mktemp("gpu-policy")
    new = router_perturbed(MOE, root / "new", scale=0.1)
    run = root / "run"
    device = f"device={DEVICE}"
    probe("generate", "--model", MOE, "--prompts", PROMPTS, "--out", run, "--engine", "hf", "--engine-arg", device,
          "--num-prompts", NUM_PROMPTS, "--max-new-tokens", 32, "--dtype", "bf16", "--batch-size", 8)  # fmt: skip
    hf = ("--engine", "hf", "--engine-arg", device, "--dtype", "fp32", "--router-logprobs")
    probe("rescore", run, *hf)
    probe("rescore", run, *hf, "--replay", "r3")
    probe("rescore", run, *hf, "--model", new, "--old", "hf-fp32", "--policy-step", 1)
    probe("rescore", run, *hf, "--model", new, "--old", "hf-fp32", "--policy-step", 1, "--replay", "r2")
    probe("rescore", run, *hf, "--model", new, "--old", "hf-fp32-r3", "--policy-step", 1, "--replay", "r3")
    probe("rescore", run, *hf, "--model", MOE, "--old", "hf-fp32", "--policy-step", 0, "--replay", "r2")
    probe("report", run)
    return run


def test_policy_passes_on_cuda(policy_run):
    """R2 at the rollout's checkpoint reproduces the θ_old pass bit for bit on the device too; a router-only
    change is mostly undone by R2; the page has its staleness section."""
    old, same = (
        pq.read_table(sorted((policy_run / "scores" / n).glob("*.parquet"))) for n in ("hf-fp32", "hf-fp32-r2-step0")
    )
    for column in ("logprob", "experts", "expert_logprobs"):
        assert old.column(column).equals(same.column(column)), column
    comps = {c["candidate"]: c for c in json.loads((policy_run / "report" / "metrics.json").read_text())["comparisons"]}
    step0, natural, r2 = (
        comps[f"scores/{n}"]["metrics"] for n in ("hf-fp32-r2-step0", "hf-fp32-step1", "hf-fp32-r2-step1")
    )
    assert step0["k3_kl"] == 0 and step0["router_shift_ratio_mean"] == 1 and step0["replay_bias_k3_kl"] == 0
    assert r2["k3_kl"] < natural["k3_kl"] / 3 and natural["router_shift_ratio_mean"] < 1
    split = r2["tid_log_ratio_var"] + r2["stale_log_ratio_var"] + 2 * r2["tid_stale_log_ratio_cov"]
    assert abs(r2["total_log_ratio_var"] - split) <= 1e-12
    assert "Policy staleness" in (policy_run / "report" / "index.html").read_text()
