"""`probe diagnose` on the demo models: the plan and its passes, the shares the quantized and truncated rollout
calls for, one checkpoint load per configuration, reuse and resume, the budget, the dry run and bad input."""

from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf import training as hf_training
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline.diagnose.checks import parse_budget
from mismatch_probe.pipeline.diagnose.estimate import order
from mismatch_probe.pipeline.diagnose.execute import Executor
from mismatch_probe.pipeline.diagnose.passes import STATUSES, Pass
from tests.conftest import DEMO_DENSE, DEMO_MOE, DEMO_PROMPTS

runner = CliRunner()
# 4 prompts, 8 new tokens, 2 samples a part file: two parts, so a pass can be interrupted between them
SMALL = ["--num-prompts", 4, "--max-new-tokens", 8, "--batch-size", 2, "--seed", 1]
# fp8 weights and top-p 0.7 with processed log-probs: an MoE rollout for which every pass applies
PRODUCTION = ["--engine-arg", "weight_quant=fp8-block128", "--top-p", 0.7, "--logprobs-mode", "processed"]
PLAN_KEYS = {"name", "question", "command", "status", "why", "estimate_s", "seconds"}


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def plan_of(run: Path) -> dict:
    return json.loads((run / "diagnose" / "plan.json").read_text())


def statuses(plan: dict) -> dict[str, str]:
    return {p["name"]: p["status"] for p in plan["passes"]}


def logprobs(folder: Path) -> pl.DataFrame:
    return pl.read_parquet(folder / "*.parquet").select("sample_id", "position", "logprob")


def score_files(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in sorted((run / "scores").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory) -> tuple[Path, float, int]:
    """One MoE diagnosis of the second form (generate first), its wall time and the training loads it made."""
    run = tmp_path_factory.mktemp("diagnose") / "moe"
    counted = [0]
    original = hf_training.load_hf_model

    def counting(*args, **kwargs):
        counted[0] += 1
        return original(*args, **kwargs)

    hf_training.load_hf_model = counting
    try:
        started = time.perf_counter()
        result = probe("diagnose", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL, *PRODUCTION)
        seconds = time.perf_counter() - started
    finally:
        hf_training.load_hf_model = original
    assert result.exit_code == 0, result.output
    return run, seconds, counted[0]


@pytest.mark.slow
def test_moe_every_pass_ran_with_both_shares(diagnosed):
    run, _, counted = diagnosed
    plan = plan_of(run)
    assert all(PLAN_KEYS <= set(p) and p["status"] in STATUSES for p in plan["passes"])
    assert statuses(plan) == {
        name: "ran"
        for name in ("generate", "matched", "fp32", "repeats", "r3", "quant", "sampling", "doctor", "sweep")
        + ("locate", "report")
    } | {"engine-prefill": "skipped"}  # an hf rollout: no inference server with a prefill of its own
    assert {p["name"]: p["command"] for p in plan["passes"]}["quant"] == (
        f"probe rescore {run} --engine hf --dtype bf16 --model {DEMO_MOE} --engine-arg weight_quant=fp8-block128 "
        "--name hf-bf16-quant"
    )
    sets = sorted(p.name for p in (run / "scores").iterdir())
    assert sets == sorted(
        ["hf-bf16", "hf-fp32", "hf-bf16-pass1", "hf-bf16-pass2", "hf-bf16-r3", "hf-bf16-quant", "hf-bf16-sampled"]
        + ["hf-bf16+lm_head_dtype-fp32", "hf-bf16+router_dtype-fp32"]
    )
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    for share in ("quant_share", "truncation_share", "routing_share"):
        entries = metrics["attribution"][share]
        assert entries and entries[0]["share"] is not None, share
    assert metrics["attribution"]["quant_share"][0]["matched"] == "scores/hf-bf16-quant"
    assert metrics["attribution"]["truncation_share"][0]["matched"] == "scores/hf-bf16-sampled"
    assert metrics["remedies"]  # the sweep's variants, measured
    # one load per configuration: bf16 (matched, repeats, r3, sampling and the sweep's knobs), its fp8 quantization,
    # fp32; locate loads its own two hooked models. By hand: 6 rescores and a sweep, 7 loads, and locate's 2.
    assert plan["checkpoint_loads"]["planned"] == plan["checkpoint_loads"]["made"] == 3
    assert counted == 3 + 2
    located = {p["name"]: p for p in plan["passes"]}["locate"]
    assert located["command"] == f"probe locate {run} --b hf:fp32 --worst 4 --samples 2"
    assert "layer" in located["result"] and "bitwise" not in located["result"]
    page = (run / "report" / "index.html").read_text()
    assert "How this was measured" in page and "probe rescore" in page and "--replay r3" in page
    # the verdict speaks of the matched pass, though diagnostic sets (fp32, a sweep variant, ...) have larger k3
    roles = {p.name: json.loads((p / "manifest.json").read_text())["role"] for p in (run / "scores").iterdir()}
    assert roles["hf-bf16"] == "matched" and roles["hf-fp32"] == "fp32" and roles["hf-bf16-pass1"] == "repeats"
    assert roles["hf-bf16-quant"] == "quant" and roles["hf-bf16+router_dtype-fp32"] == "sweep"
    k3 = {c["candidate"]: c["metrics"]["k3_kl"] for c in metrics["comparisons"] if c["reference"] == "rollout"}
    assert max(k3.values()) > k3["scores/hf-bf16"]
    verdict = next(line for line in probe("diagnose", run).output.splitlines() if line.startswith("verdict: "))
    assert "(rollout vs scores/hf-bf16" in verdict and verdict.endswith(": the matched set).")


@pytest.mark.slow
def test_rerun_reuses_everything_and_continues_an_interrupted_pass(diagnosed, tmp_path):
    first_run, first_seconds, _ = diagnosed
    run = Path(shutil.copytree(first_run, tmp_path / "moe"))
    before = score_files(run)
    started = time.perf_counter()
    result = probe("diagnose", run)
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started < first_seconds / 2
    rerun = statuses(plan_of(run))
    assert rerun.pop("engine-prefill") == "skipped" and set(rerun.values()) == {"reused"}  # an hf rollout
    assert "generate" in rerun  # the second form's sampling stays in the record, reused
    assert score_files(run) == before  # nothing rescored, no file under scores/ touched
    assert "plan: " in result.output and "verdict: " in result.output and "locate: " in result.output
    # a pass's command does it again by hand: the same log-probs
    quant = {p["name"]: p["command"] for p in plan_of(run)["passes"]}["quant"]
    shutil.rmtree(run / "scores" / "hf-bf16-quant")
    result = probe(*shlex.split(quant)[1:])
    assert result.exit_code == 0, result.output
    assert logprobs(run / "scores" / "hf-bf16-quant").equals(logprobs(first_run / "scores" / "hf-bf16-quant"))
    before = score_files(run)
    # interrupt fp32 after its first part: the next diagnose scores only the missing part
    fp32 = run / "scores" / "hf-fp32"
    parts = sorted(fp32.glob("part-*.parquet"))
    parts[-1].unlink()
    manifest = json.loads((fp32 / "manifest.json").read_text())
    (fp32 / "manifest.json").write_text(json.dumps(manifest | {"status": "running"}))
    kept = parts[0].stat().st_mtime_ns
    result = probe("diagnose", run, "--json")
    assert result.exit_code == 0, result.output
    done = statuses(plan_of(run))
    assert done.pop("fp32") == "ran" and done.pop("report") == "ran" and done.pop("doctor") == "ran"
    assert done.pop("engine-prefill") == "skipped"
    assert set(done.values()) == {"reused"} and "generate" in done
    generate = {p["name"]: p["command"] for p in plan_of(run)["passes"]}["generate"]
    assert generate.startswith("probe generate ") and generate in (run / "report" / "index.html").read_text()
    assert parts[0].stat().st_mtime_ns == kept and parts[-1].is_file()
    assert {k: v for k, v in score_files(run).items() if "hf-fp32" not in k} == {
        k: v for k, v in before.items() if "hf-fp32" not in k
    }


@pytest.fixture(scope="module")
def plain_moe(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("diagnose-plain") / "run"
    result = probe("generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL)
    assert result.exit_code == 0, result.output
    return run


def test_budget_skips_what_does_not_fit(plain_moe, tmp_path):
    run = Path(shutil.copytree(plain_moe, tmp_path / "run"))
    result = probe("diagnose", run, "--budget", "1s")
    assert result.exit_code == 0, result.output
    plan = plan_of(run)
    assert plan["budget_s"] == 1.0
    by_name = {p["name"]: p for p in plan["passes"]}
    for name in ("matched", "fp32", "repeats", "r3", "sweep", "locate"):
        assert (by_name[name]["status"], by_name[name]["why"]) == ("skipped", "budget")
        assert by_name[name]["command"].startswith(
            f"probe {'sweep' if name == 'sweep' else 'locate' if name == 'locate' else 'rescore'} {run}"
        )
    assert by_name["quant"]["why"] == "the rollout is not quantized"
    assert by_name["report"]["status"] == "skipped"
    assert not (run / "scores").exists()


def test_dry_run_of_a_dense_run_plans_without_r3(tmp_path):
    run = tmp_path / "dense"
    result = probe("generate", "--model", DEMO_DENSE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL)
    assert result.exit_code == 0, result.output
    result = probe("diagnose", run, "--dry-run")
    assert result.exit_code == 0, result.output
    plan = plan_of(run)
    by_name = {p["name"]: p for p in plan["passes"]}
    assert (by_name["r3"]["status"], by_name["r3"]["why"]) == ("skipped", "dense model: no routing to replay")
    assert {by_name[n]["status"] for n in ("matched", "fp32", "repeats", "sweep", "locate", "report")} == {"planned"}
    assert by_name["sweep"]["command"] == f"probe sweep {run} --engine hf --dtype bf16 --vary lm_head_dtype=fp32"
    assert all(p["estimate_s"] > 0 for p in plan["passes"] if p["status"] == "planned")
    assert plan["checkpoint_loads"]["planned"] == 2
    assert not (run / "scores").exists() and not (run / "report").exists()
    assert "probe rescore" in result.output


def test_bad_input_exits_2_and_creates_nothing(plain_moe, tmp_path):
    out = tmp_path / "new-run"
    result = probe("diagnose", "--model", tmp_path / "missing", "--prompts", DEMO_PROMPTS, "--out", out)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --model {tmp_path / 'missing'}: no checkpoint there (expected a folder with config.json)"
    ]
    assert not out.exists()
    run = Path(shutil.copytree(plain_moe, tmp_path / "run"))
    result = probe("diagnose", run, "--train-arg", "lm_head=fp32")
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: --train-arg lm_head: unknown key for --engine hf (valid keys: ")
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "rollout"]
    result = probe("diagnose", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL, "--top-p", 0.7)
    assert result.exit_code == 2  # the second form refuses a RUN that holds a rollout sampled otherwise
    assert result.output.strip() == (
        f"error: {run}: holds a rollout sampled with top_p 1.0, this command samples with 0.7; give another --out, "
        f"or diagnose that rollout with `probe diagnose {run}`"
    )
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "rollout"]
    result = probe("diagnose", tmp_path / "nowhere")
    assert result.exit_code == 2
    assert "not a probe run (no manifest.json)" in result.output and not (tmp_path / "nowhere").exists()


def test_budget_durations():
    assert [parse_budget(t) for t in ("90s", "20m", "1.5h", "1h30m", "45")] == [90, 1200, 5400, 5400, 45]
    for bad in ("", "m", "5q", "0s", "-1m"):
        with pytest.raises(Exception, match="--budget"):
            parse_budget(bad)


def test_order_keeps_each_checkpoint_together_matched_first():
    def p(name, group, estimate):
        return Pass(name=name, command="", group=group, estimate_s=estimate)

    passes = [
        p("fp32", "hf fp32", 2.0),
        p("quant", "hf bf16 weight_quant=x", 1.0),
        p("report", None, 1.0),
        p("doctor", None, 0.5),
        p("sweep", "hf bf16", 0.1),
        p("repeats", "hf bf16", 2.0),
        p("r3", "hf bf16", 1.0),
        p("matched", "hf bf16", 5.0),
        p("locate", None, 50.0),
    ]
    # matched first; its checkpoint's passes by value per second, the sweep (which switches the engine away) last;
    # then quant (8/1 s) before fp32 (5/2 s) and locate (2/50 s); the doctor, then the report, last
    assert [q.name for q in order(passes)] == [
        "matched",
        "r3",
        "repeats",
        "sweep",
        "quant",
        "fp32",
        "locate",
        "doctor",
        "report",
    ]


def test_a_failed_pass_exits_1_and_the_others_still_run(plain_moe, tmp_path, monkeypatch):
    """The loop alone: every pass's work replaced by a stub, fp32's raising as an engine's check would."""

    def rescore(self, p):
        if p.name == "fp32":
            raise ProbeError("--engine-arg device=cuda: no CUDA device")
        return f"{p.name} stub"

    monkeypatch.setattr(Executor, "_rescore", rescore)
    for name in ("_sweep", "_locate"):
        monkeypatch.setattr(Executor, name, lambda self, p: f"{p.name} stub")
    run = Path(shutil.copytree(plain_moe, tmp_path / "run"))
    result = probe("diagnose", run)
    assert result.exit_code == 1, result.output
    by_name = {p["name"]: p for p in plan_of(run)["passes"]}
    assert (by_name["fp32"]["status"], by_name["fp32"]["why"]) == ("failed", "--engine-arg device=cuda: no CUDA device")
    assert {by_name[n]["status"] for n in ("matched", "repeats", "r3", "sweep", "locate")} == {"ran"}
    assert by_name["report"]["why"] == "no score set to read: the scoring passes were skipped or failed"
