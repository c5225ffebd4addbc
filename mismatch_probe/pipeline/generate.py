"""`probe generate`: sample with an inference engine and stream the rollout token table."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe import __version__
from mismatch_probe.engines import engine_class, inference_engine, resolved_options
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.extras import require_engine
from mismatch_probe.engines.memory import OutOfMemory, batch_line, context, unless_out_of_memory
from mismatch_probe.engines.weight_files import weights_sha256
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info
from mismatch_probe.pipeline.prompts import load_prompts
from mismatch_probe.progress import console, progress_bar
from mismatch_probe.rundir.layout import RUN_LAYOUT, Run, prepare_output, removed_unless_written
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest, file_sha256
from mismatch_probe.rundir.parts import completed_sample_ids, write_part
from mismatch_probe.rundir.records import PromptRequest
from mismatch_probe.schema import token_schema


@dataclass(frozen=True)
class GenerateJob:
    model: Path
    prompts: Path
    out: Path
    engine: str
    params: SamplingParams
    config: EngineConfig
    samples_per_prompt: int = 1
    num_prompts: int | None = None
    resume: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False  # load the checkpoint's own modeling code
    moe_family: str | None = None  # --moe-family: overrides the family recognised from model_type or modules


@dataclass(frozen=True, kw_only=True)
class StoredPrompts:
    """Prompts already tokenized, as another run stored them (`probe sweep`'s sibling runs): their ids, and the
    file and hash that run's manifest records for them, which the new manifest records too."""

    ids: list[list[int]]
    file: str
    sha256: str | None


def windows(requests: list[PromptRequest], size: int) -> list[list[PromptRequest]]:
    """Fixed windows [k*size, (k+1)*size) of sample ids, split at gaps left by finished parts."""
    out: list[list[PromptRequest]] = []
    for request in requests:
        last = out[-1][-1] if out else None
        if last and last.sample_id + 1 == request.sample_id and last.sample_id // size == request.sample_id // size:
            out[-1].append(request)
        else:
            out.append([request])
    return out


def run_generate(job: GenerateJob, stored: StoredPrompts | None = None) -> Run:
    """Sample into job.out; the prompts come from job.prompts, or, given `stored`, are those token ids."""
    require_engine(job.engine)
    engine_class("inference", job.engine).check_logprobs_mode(job.params)
    run = Run(job.out)
    created = not job.out.exists()
    prepare_output(job.out, job.resume, job.overwrite, "run", RUN_LAYOUT)
    if job.resume:
        return _generate(job, run, stored)
    with removed_unless_written(run, created):
        return _generate(job, run, stored)


def _generate(job: GenerateJob, run: Run, stored: StoredPrompts | None) -> Run:
    model = load_model_info(job.model, job.trust_remote_code, job.moe_family)
    job = _resolved(job, run)
    prompts = stored.ids if stored else load_prompts(job.prompts, job.model, job.trust_remote_code)
    prompts = prompts[: job.num_prompts]
    requests = [
        PromptRequest(sample_id=p * job.samples_per_prompt + j, prompt_id=p, prompt_ids=ids)
        for p, ids in enumerate(prompts)
        for j in range(job.samples_per_prompt)
    ]
    engine = inference_engine(job.engine, model, job.config)
    engine.check_ready(job.params)
    source = (stored.file, stored.sha256) if stored else (str(job.prompts.resolve()), file_sha256(job.prompts))
    manifest = _manifest(job, model, engine, len(prompts), len(requests), source)
    if job.resume:
        old = run.manifest()
        old.check_resumable(manifest, run.manifest_path)
        manifest.created_at, manifest.window_size = old.created_at, old.window_size
        manifest.tokens_per_second = old.tokens_per_second
    manifest.save(run.manifest_path)

    schema = token_schema(
        manifest.routing,
        with_router_margin=engine.writes_router_margin,
        with_kept_logmass=engine.writes_kept_logmass,
        with_serving_path=engine.writes_serving_path,
    )
    done = set(completed_sample_ids(run.rollout_dir).tolist())
    todo = [r for r in requests if r.sample_id not in done]
    tokens, started = 0, time.perf_counter()
    with progress_bar() as bar:
        task = bar.add_task(f"generate ({job.engine})", total=len(requests), completed=len(done), unit="samples")
        for window in windows(todo, manifest.window_size):
            records = unless_out_of_memory(engine.generate, window, job.params)
            if records is None:  # out of memory: raised here, where the failed window's tensors are gone
                raise _stopped(job, model, run, manifest, window, len(requests))
            write_part(run.rollout_dir, records, schema, manifest.routing)
            tokens += sum(len(r) - r.prompt_len for r in records)
            done.update(r.sample_id for r in window)
            manifest.completed_samples = len(done)
            manifest.engine = engine.describe()  # running statistics, e.g. SGLang's cached_tokens
            manifest.save(run.manifest_path)
            bar.advance(task, len(window))
    engine.close()
    manifest.status = COMPLETE
    elapsed = time.perf_counter() - started
    if tokens:  # a resume with nothing left to sample keeps the speed of the run that sampled
        manifest.tokens_per_second = tokens / max(elapsed, 1e-9)
    manifest.save(run.manifest_path)
    console.print(
        f"generated {len(todo)} samples, {tokens} response tokens in {elapsed:.1f}s "
        f"({tokens / max(elapsed, 1e-9):.0f} tok/s) -> {run.rollout_dir}"
    )
    return run


def _stopped(job: GenerateJob, model: ModelInfo, run: Run, manifest, window, total: int) -> OutOfMemory:
    """Out of memory in a window: its samples are not written, those before it are kept, the manifest (still
    unfinished, so --resume continues) says where it stopped; one line naming what would fit."""
    done = manifest.completed_samples or 0
    kept = f"{done} of {total} samples are kept and {run.manifest_path} says incomplete"
    width = max(len(r.prompt_ids) for r in window) + job.params.max_new_tokens
    tokens = sum(len(r.prompt_ids) for r in window) + len(window) * job.params.max_new_tokens
    ctx = context("generate", job.engine, model, job.config)
    where = f"samples {window[0].sample_id}-{window[-1].sample_id}"
    line = batch_line(ctx, where, (len(window), tokens, width), kept, chunk=False)
    manifest.incomplete = {"stopped_at": window[0].sample_id, "samples_done": done, "samples": total, "why": line}
    manifest.save(run.manifest_path)
    return OutOfMemory(line)


def _manifest(
    job: GenerateJob, model: ModelInfo, engine, num_prompts: int, num_samples: int, source: tuple[str, str | None]
) -> RolloutManifest:
    return RolloutManifest.started(
        tool_version=__version__,
        **model.manifest_fields(),
        engine=engine.describe(),
        eos_token_ids=engine.end_ids(),
        dtype=engine.dtype,
        quantization=engine.quantization(),
        sampling=job.params.to_dict(),
        scoring_temperature=job.params.scoring_temperature,
        seed=job.params.seed,
        prompts_file=source[0],
        prompts_sha256=source[1],
        num_prompts=num_prompts,
        samples_per_prompt=job.samples_per_prompt,
        num_samples=num_samples,
        batch_size=job.config.batch_size,
        window_size=engine.window_size,
        completed_samples=0,
        weights_sha256=weights_sha256(model.path),
        engine_options=resolved_options("inference", job.engine, job.config.engine_args),
    )


def _resolved(job: GenerateJob, run: Run) -> GenerateJob:
    """On --resume, the sampling and batching of the original run win (the same seeds give the same samples)."""
    if not job.resume:
        return job
    old = run.manifest()
    params = SamplingParams(**old.sampling)
    config = EngineConfig(**{**job.config.__dict__, "batch_size": old.batch_size, "dtype": old.dtype})
    return GenerateJob(
        **{
            **job.__dict__,
            "params": params,
            "config": config,
            "samples_per_prompt": old.samples_per_prompt,
            "num_prompts": old.num_prompts,
        }
    )
