"""`probe diagnose`'s input, checked before anything is created: the run (or what samples it), the checkpoint, the
training engine, its options (the engine's own option check), the dtype. Each failure is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.engines import check_engine_args, engine_class
from mismatch_probe.engines.extras import require_engine
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.pipeline.diagnose.job import DiagnoseJob, RolloutFacts
from mismatch_probe.quant.served import matched_quant_args
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import part_files
from mismatch_probe.vocab import DTYPES


def _checkpoint(path: Path, flag: str = "--model") -> None:
    if not (Path(path) / "config.json").is_file():
        raise ProbeError(f"{flag} {path}: no checkpoint there (expected a folder with config.json)")


def _train_args(engine: str, args: dict) -> None:
    try:
        check_engine_args("training", engine, args)
    except ProbeError as err:  # the engine names its own flag; here the options came as --train-arg
        raise ProbeError(str(err).replace("--engine-arg", "--train-arg", 1)) from None


def check_inputs(job: DiagnoseJob) -> None:
    try:
        engine_class("training", job.train_engine)
    except ProbeError as err:
        raise ProbeError(str(err).replace("--engine:", "--train-engine:", 1)) from None
    require_engine(job.train_engine)
    if job.dtype is not None and job.dtype not in DTYPES:
        raise ProbeError(f"--dtype: '{job.dtype}' is not one of {', '.join(DTYPES)}")
    _train_args(job.train_engine, job.train_args)
    if job.model is not None:
        _checkpoint(job.model)
        load_model_info(job.model, job.trust_remote_code, job.moe_family)
    run = Run(job.run)
    if job.generate is not None:
        if not Path(job.generate.prompts).is_file():
            raise ProbeError(f"--prompts {job.generate.prompts}: prompts file not found")
        if job.run.exists() and not run.manifest_path.is_file() and any(job.run.iterdir()):
            raise ProbeError(f"--out {job.run}: exists and is not a probe run; give an empty or new folder")
        check_engine_args("inference", job.generate.engine, job.generate.config.engine_args)
        require_engine(job.generate.engine)
        if run.manifest_path.is_file():
            _same_rollout(run, job.generate)
        return
    if not run.manifest_path.is_file():
        raise ProbeError(
            f"{job.run}: not a probe run (no manifest.json); to sample one first, give --model CKPT --prompts FILE"
        )
    manifest = run.manifest()
    manifest.check_finished(run.manifest_path)
    if job.model is None and manifest.model is not None:
        _checkpoint(Path(manifest.model), f"{run.manifest_path}: model")
    quant = matched_quant_args(manifest.quantization, job.model or manifest.model)
    if quant and job.train_engine == "hf":
        _train_args(job.train_engine, {**job.train_args, **quant})


def _same_rollout(run: Run, gen) -> None:
    """A second form given a RUN that holds a rollout already continues or reuses it: only one sampled as this
    command samples (the same engine, dtype and sampling)."""
    manifest = run.manifest()
    recorded = manifest.sampling if isinstance(manifest.sampling, dict) else {}
    p = gen.params
    wanted = {
        "engine": gen.engine,
        "dtype": gen.config.dtype,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "max_new_tokens": p.max_new_tokens,
        "seed": p.seed,
        "logprobs_mode": p.logprobs_mode,
    }
    have = recorded | {"engine": manifest.engine_name, "dtype": manifest.dtype}
    if gen.engine != "hf":  # a server engine records the server's dtype, not --dtype
        wanted.pop("dtype")
    for key, value in wanted.items():
        if key in have and have[key] != value:
            raise ProbeError(
                f"{run.root}: holds a rollout sampled with {key} {have[key]!r}, this command samples with "
                f"{value!r}; give another --out, or diagnose that rollout with `probe diagnose {run.root}`"
            )


def rollout_facts(job: DiagnoseJob) -> RolloutFacts:
    """From the run's manifest and parts; for a dry run of the second form, from the generate job."""
    run = Run(job.run)
    if run.manifest_path.is_file():
        import pyarrow.parquet as pq

        tokens = sum(pq.ParquetFile(p).metadata.num_rows for p in part_files(run.rollout_dir))
        return RolloutFacts.of_manifest(run.manifest(), tokens)
    gen = job.generate
    info = load_model_info(gen.model, gen.trust_remote_code, gen.moe_family)
    lines = [line for line in Path(gen.prompts).read_text().splitlines() if line.strip()]
    prompts = min(len(lines), gen.num_prompts or len(lines))
    return RolloutFacts.of_generate(gen, info.routing.is_moe, prompts, prompt_tokens=prompts * 32)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_budget(text: str | None) -> float | None:
    """`--budget 20m`: seconds from `90s`, `20m`, `1.5h`, `1h30m` or a bare number of seconds."""
    if text is None:
        return None
    import re

    spelled = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)([smh]?)", spelled)
    if not parts or "".join(n + u for n, u in parts) != spelled:
        raise ProbeError(f"--budget {text!r}: expected a duration such as 90s, 20m, 1.5h or 1h30m")
    seconds = sum(float(n) * _UNITS[u or "s"] for n, u in parts)
    if seconds <= 0:
        raise ProbeError(f"--budget {text!r}: expected a duration above 0")
    return seconds
