"""`probe sweep` end to end on a tiny MoE model: variants' score sets and names, the base they may be, reuse and
resume, checkpoint loads, sibling runs for rollout-side knobs, sweep.json, and bad --vary input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.hf import inference as hf_inference
from mismatch_probe.engines.hf import training as hf_training
from mismatch_probe.engines.options import build_options

runner = CliRunner()
GEN = ["--samples-per-prompt", 2, "--max-new-tokens", 5, "--batch-size", 4, "--seed", 3, "--temperature", 0.9]


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    result = probe(*args)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sweep-prompts") / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"input_ids": [3 + i, 7 + i, 11 + 2 * i][: 2 + i % 2]}) + "\n" for i in range(4))
    )
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_moe, prompts) -> Path:
    run = tmp_path_factory.mktemp("sweep-runs") / "run"
    ok("generate", "--model", tiny_moe, "--prompts", prompts, "--out", run, "--dtype", "bf16", *GEN)
    return run


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


@pytest.fixture
def loads(monkeypatch) -> dict[str, int]:
    """Checkpoint loads by the training and the inference engine."""
    counts = {"training": 0, "inference": 0}
    for kind, module in (("training", hf_training), ("inference", hf_inference)):
        original = module.load_hf_model

        def counted(*args, _kind=kind, _original=original, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "load_hf_model", counted)
    return counts


def switch_logprob_chunk(self, engine_args: dict) -> bool:
    """A reconfigure that switches logprob_chunk on the loaded model, and nothing else."""
    new = build_options(self.Options, self.name, engine_args)
    kept = [f.name for f in dataclasses.fields(new) if f.name != "logprob_chunk"]
    if any(getattr(new, key) != getattr(self.options, key) for key in kept):
        return False
    self.options = new
    return True


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def logprobs(folder: Path) -> pl.DataFrame:
    return pl.read_parquet(folder / "*.parquet").select("sample_id", "position", "logprob", "experts")


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("*.parquet"))}


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_training_variants_named_scored_and_recorded(run, tmp_path):
    ok("sweep", run, "--vary", "dtype=fp32", "--vary", "weight_quant=fp8-tensor", "--vary", "logprob_chunk=256")
    sets = sorted(p.name for p in (run / "scores").iterdir())
    assert sets == ["hf-bf16", "hf-bf16+dtype-fp32", "hf-bf16+weight_quant-fp8-tensor"]  # chunk 256 is the default
    rollout = manifest(run)
    for name, dtype, quant in (
        ("hf-bf16", "bf16", None),
        ("hf-bf16+dtype-fp32", "fp32", None),
        ("hf-bf16+weight_quant-fp8-tensor", "bf16", "fp8-tensor"),
    ):
        meta = manifest(run / "scores" / name)
        assert (meta["status"], meta["dtype"], meta["replay"]) == ("complete", dtype, "none")
        assert meta["engine_options"]["weight_quant"] == quant and meta["engine_options"]["logprob_chunk"] == 256
        assert meta["rollout_created_at"] == rollout["created_at"] and meta["tokens_per_second"] > 0
    # the fp32 variant is what `probe rescore --dtype fp32` computes from a fresh load
    ok("rescore", run, "--dtype", "fp32", "--name", "plain-fp32")
    assert logprobs(run / "scores" / "plain-fp32").equals(logprobs(run / "scores" / "hf-bf16+dtype-fp32"))
    assert not logprobs(run / "scores" / "hf-bf16").equals(logprobs(run / "scores" / "hf-bf16+dtype-fp32"))
    sweep = json.loads((run / "sweep.json").read_text())
    assert sweep == {
        "engine": "hf",
        "dtype": "bf16",
        "engine_args": {},
        "base": "hf-bf16",
        "variants": [
            {
                "variant": "hf-bf16+dtype-fp32",
                "side": "training",
                "changed": {"dtype": "fp32"},
                "run": ".",
                "score_set": "hf-bf16+dtype-fp32",
            },
            {
                "variant": "hf-bf16+weight_quant-fp8-tensor",
                "side": "training",
                "changed": {"weight_quant": "fp8-tensor"},
                "run": ".",
                "score_set": "hf-bf16+weight_quant-fp8-tensor",
            },
            {  # equal to the base: recorded as the base, no second set
                "variant": "hf-bf16+logprob_chunk-256",
                "side": "training",
                "changed": {"logprob_chunk": "256"},
                "run": ".",
                "score_set": "hf-bf16",
            },
        ],
    }


def test_variant_the_engine_describes_as_the_base_is_the_base(run, monkeypatch):
    """A knob describe() records with its effective value, equal to the base's there: no second set."""
    describe = hf_training.HFTrainingEngine.describe
    monkeypatch.setattr(
        hf_training.HFTrainingEngine, "describe", lambda self: describe(self) | {"logprob_chunk": "effective"}
    )
    ok("sweep", run, "--vary", "logprob_chunk=64")
    assert sorted(p.name for p in (run / "scores").iterdir()) == ["hf-bf16"]
    (variant,) = json.loads((run / "sweep.json").read_text())["variants"]
    assert (variant["variant"], variant["score_set"]) == ("hf-bf16+logprob_chunk-64", "hf-bf16")
    monkeypatch.setattr(hf_training.HFTrainingEngine, "describe", describe)  # the describe tells them apart
    ok("sweep", run, "--vary", "logprob_chunk=32")
    assert (run / "scores" / "hf-bf16+logprob_chunk-32").is_dir()


def test_second_sweep_reuses_and_interrupted_one_resumes(run, loads):
    args = ("sweep", run, "--vary", "dtype=fp32", "--vary", "logprob_chunk=64")
    ok(*args)
    assert loads["training"] == 2  # base and fp32; chunk 64 switched on the loaded bf16 model (reconfigure)
    base, fp32 = run / "scores" / "hf-bf16", run / "scores" / "hf-bf16+dtype-fp32"
    before = {folder: mtimes(folder) for folder in (base, fp32)}
    expected = logprobs(fp32)
    ok(*args)
    assert loads["training"] == 2 and {folder: mtimes(folder) for folder in (base, fp32)} == before
    # interrupted: a part of one set lost, another set left running with all its parts
    first = sorted(fp32.glob("*.parquet"))[0]
    first.unlink()
    meta = manifest(base) | {"status": "running"}
    (base / "manifest.json").write_text(json.dumps(meta))
    ok(*args)
    assert loads["training"] == 3  # one load: fp32's lost part; the running set had nothing left to score
    assert mtimes(base) == before[base] and manifest(base)["status"] == "complete"
    assert manifest(base)["created_at"] == meta["created_at"]
    assert first.is_file() and logprobs(fp32).equals(expected)
    assert {k: v for k, v in mtimes(fp32).items() if k != first.name} == {
        k: v for k, v in before[fp32].items() if k != first.name
    }


def test_checkpoint_loaded_once_where_the_engine_reconfigures(run, loads, monkeypatch):
    monkeypatch.setattr(hf_training.HFTrainingEngine, "reconfigure", switch_logprob_chunk)
    result = ok("sweep", run, "--vary", "logprob_chunk=16,64,128", "--vary", "dtype=fp32")
    assert loads["training"] == 2  # bf16 once for the base and its three chunk sizes, fp32 once
    assert "checkpoint loads: 2; variants switched on a loaded model: 3" in result.output
    # a variant scored on the reconfigured model is what a fresh load with that option scores
    ok("rescore", run, "--dtype", "bf16", "--engine-arg", "logprob_chunk=16", "--name", "fresh-16")
    assert logprobs(run / "scores" / "fresh-16").equals(logprobs(run / "scores" / "hf-bf16+logprob_chunk-16"))
    assert manifest(run / "scores" / "hf-bf16+logprob_chunk-16")["engine_options"]["logprob_chunk"] == 16


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
@pytest.mark.slow  # two rollouts sampled, three sweeps
def test_rollout_and_both_variants_make_a_sibling_run(run, tiny_moe, prompts, tmp_path, loads):
    reference = tmp_path / "reference"  # what `probe generate --dtype fp32` samples from the same prompts and seed
    ok("generate", "--model", tiny_moe, "--prompts", prompts, "--out", reference, "--dtype", "fp32", *GEN)
    loads.update(training=0, inference=0)
    moved = prompts.with_suffix(".moved")
    prompts.rename(moved)  # the sibling takes RUN's stored prompt ids, not the prompts file
    try:
        ok("sweep", run, "--vary", "rollout:dtype=fp32", "--vary", "both:dtype=fp32")
    finally:
        moved.rename(prompts)
    sibling = run.parent / "run+rollout.dtype-fp32"
    assert sorted(p.name for p in (sibling / "scores").iterdir()) == ["hf-bf16", "hf-bf16+dtype-fp32"]
    assert sorted(p.name for p in (run / "scores").iterdir()) == ["hf-bf16"]
    ours, theirs = manifest(run), manifest(sibling)
    assert theirs["dtype"] == "fp32" and theirs["engine_options"] == ours["engine_options"]
    for key in (
        "sampling",
        "seed",
        "prompts_file",
        "prompts_sha256",
        "num_prompts",
        "samples_per_prompt",
        "batch_size",
    ):
        assert theirs[key] == ours[key], key
    columns = ["sample_id", "prompt_id", "position", "token_id", "is_response", "logprob"]
    prompt_rows = ["sample_id", "prompt_id", "position", "token_id"]
    got, ran = pl.read_parquet(sibling / "rollout").select(columns), pl.read_parquet(run / "rollout").select(columns)
    assert (
        got.filter(~pl.col("is_response"))
        .select(prompt_rows)
        .equals(ran.filter(~pl.col("is_response")).select(prompt_rows))
    )
    assert got.equals(pl.read_parquet(reference / "rollout").select(columns))  # same seeds, same samples
    assert manifest(sibling / "scores" / "hf-bf16+dtype-fp32")["dtype"] == "fp32"
    variants = json.loads((run / "sweep.json").read_text())["variants"]
    assert variants == [
        {
            "variant": "run+rollout.dtype-fp32",
            "side": "rollout",
            "changed": {"dtype": "fp32"},
            "run": "../run+rollout.dtype-fp32",
            "score_set": "hf-bf16",
        },
        {
            "variant": "run+both.dtype-fp32",
            "side": "both",
            "changed": {"dtype": "fp32"},
            "run": "../run+rollout.dtype-fp32",
            "score_set": "hf-bf16+dtype-fp32",
        },
    ]
    assert loads == {"training": 2, "inference": 1}  # one sibling for both variants; bf16 and fp32 scored
    ok("sweep", run, "--vary", "rollout:dtype=fp32", "--vary", "both:dtype=fp32")
    assert loads == {"training": 2, "inference": 1}  # all reused
    # an interrupted sibling: its last part lost, its manifest running; the same command samples that part again
    last = sorted((sibling / "rollout").glob("*.parquet"))[-1]
    last.unlink()
    (sibling / "manifest.json").write_text(json.dumps(theirs | {"status": "running"}))
    ok("sweep", run, "--vary", "rollout:dtype=fp32", "--vary", "both:dtype=fp32")
    assert loads == {"training": 2, "inference": 2} and manifest(sibling)["status"] == "complete"
    assert pl.read_parquet(sibling / "rollout").select(columns).equals(got)


def _refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], result.output


# The knobs an error lists: dtype, then the engine's options in their dataclass's order.
HF_KNOBS = ", ".join(["dtype"] + [f.name for f in dataclasses.fields(hf_training.HFTrainingEngine.Options)])
HF_ROLLOUT_KNOBS = ", ".join(["dtype"] + [f.name for f in dataclasses.fields(hf_inference.HFInferenceEngine.Options)])


@pytest.mark.parametrize(
    "vary, message",
    [
        (
            ["logprob_chunk"],
            "--vary 'logprob_chunk': expected [rollout:|both:]KNOB=V1[,V2...], e.g. lm_head_dtype=fp32 or both:dtype=fp32",
        ),
        (
            ["dtype="],
            "--vary 'dtype=': expected [rollout:|both:]KNOB=V1[,V2...], e.g. lm_head_dtype=fp32 or both:dtype=fp32",
        ),
        (
            ["sideways:dtype=fp32"],
            "--vary 'sideways:dtype=fp32': side 'sideways' is not one of training, rollout, both",
        ),
        (["bogus=1"], f"--vary bogus=1: unknown knob for the hf training engine (knobs: {HF_KNOBS})"),
        (
            ["rollout:logprob_chunk=8"],
            f"--vary rollout:logprob_chunk=8: unknown knob for the hf inference engine (knobs: {HF_ROLLOUT_KNOBS})",
        ),
        (["dtype=fp8"], "--vary dtype=fp8: expected one of bf16, fp16, fp32, fp32-bf16w"),
        (["logprob_chunk=x"], "--vary logprob_chunk=x: expected int"),
        (["logprob_chunk=0"], "--vary logprob_chunk=0: expected int >= 1"),
        (["dtype=fp32", "dtype=fp16,fp32"], "--vary dtype=fp16,fp32: dtype=fp32 is given twice"),
        (
            [],
            "--vary: give at least one knob to vary ([rollout:|both:]KNOB=V1[,V2...], e.g. lm_head_dtype=fp32 or "
            "both:dtype=fp32)",
        ),
    ],
)
def test_bad_vary_is_refused_in_one_line(pristine, vary, message):
    _refused(probe("sweep", pristine, *[a for v in vary for a in ("--vary", v)]), message)
    assert not (pristine / "scores").exists() and not (pristine / "sweep.json").exists()


def test_rollout_variants_need_an_hf_rollout(run):
    meta = manifest(run)
    (run / "manifest.json").write_text(json.dumps(meta | {"engine": {"engine": "vllm"}}))
    _refused(
        probe("sweep", run, "--vary", "rollout:dtype=fp32"),
        "--vary rollout:dtype=fp32: rollout-side variants need an --engine hf rollout (this run's rollout engine is vllm)",
    )


def test_set_made_otherwise_is_refused_then_overwritten(run):
    ok("rescore", run, "--dtype", "bf16", "--engine-arg", "logprob_chunk=64")
    _refused(
        probe("sweep", run, "--vary", "dtype=fp32"),
        f"{run / 'scores' / 'hf-bf16'}: score set 'hf-bf16' exists but was made otherwise "
        "(engine_options.logprob_chunk: 64, this sweep: 256); remove it or pass --overwrite",
    )
    assert not (run / "scores" / "hf-bf16+dtype-fp32").exists()
    ok("sweep", run, "--vary", "dtype=fp32", "--overwrite")
    assert manifest(run / "scores" / "hf-bf16")["engine_options"]["logprob_chunk"] == 256
