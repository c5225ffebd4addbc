"""`probe rescore`: push the rollout's stored token ids through a training engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.engines import resolved_options, training_engine
from mismatch_probe.engines.base import EngineConfig, ScoreOptions, TrainingEngine, Truncation
from mismatch_probe.engines.extras import require_engine
from mismatch_probe.engines.forward.scoring import is_writer_rank
from mismatch_probe.engines.memory import OutOfMemory, batch_line, context, unless_out_of_memory
from mismatch_probe.engines.weight_files import weights_sha256
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info
from mismatch_probe.pipeline.policy_pass import (
    PolicyPass,
    attach_old_experts,
    check_old_set,
    check_policy_options,
    check_router_logprobs,
)
from mismatch_probe.pipeline.prefill_set import is_prefill, mark_prefill, prefill_job
from mismatch_probe.progress import console, progress_bar
from mismatch_probe.report.steps.ranges import label_steps, step_ranges
from mismatch_probe.rundir.layout import (
    MANIFEST,
    SCORE_LAYOUT,
    Run,
    check_output,
    default_score_name,
    pass_names,
    prepare_output,
)
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest, ScoreManifest
from mismatch_probe.rundir.parts import iter_score_requests, open_part, part_files, require_parts, write_part
from mismatch_probe.rundir.records import ScoreRequest
from mismatch_probe.rundir.roles import options_role
from mismatch_probe.schema import KEPT_LOGMASS, token_schema
from mismatch_probe.vocab import (
    FP32,
    NO_REPLAY,
    PROCESSED,
    R2,
    R3,
    RAW,
    REPLAYS,
    ROLLOUT_SAMPLING,
    SCORE_SAMPLINGS,
    Replay,
    ScoreSampling,
)


@dataclass(frozen=True)
class RescoreJob:
    run: Path
    engine: str
    config: EngineConfig
    model: Path | None = None
    replay: Replay = NO_REPLAY
    repeats: int = 1
    vary_batching: bool = False
    name: str | None = None
    resume: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False  # load the checkpoint's own modeling code
    moe_family: str | None = None  # --moe-family: overrides the family recognised from model_type or modules
    old: str | None = None  # --old NAME: this is a new policy's pass, paired with that θ_old score set
    policy_step: int | None = None  # --policy-step N
    router_logprobs: bool = False  # --router-logprobs
    sampling: ScoreSampling = RAW  # --sampling rollout: the rollout's top-p/top-k on the training logits
    role: str | None = None  # --role: matched or a diagnostic role; None: the one the options imply, if any

    @property
    def set_role(self) -> str | None:
        """The role its score sets record (rundir/roles.py)."""
        if self.role is not None:
            return self.role
        options = dict(replay=self.replay, repeats=self.repeats, sampling=self.sampling, old=self.old)
        return options_role(engine_args=self.config.engine_args, **options)

    @property
    def replays(self) -> bool:
        """R3: the requests carry the rollout's experts, which is what makes an engine replay them."""
        return self.replay == R3

    @property
    def policy(self) -> PolicyPass | None:
        return None if self.old is None else PolicyPass(old=self.old, step=self.policy_step, replay=self.replay)


@dataclass(frozen=True)
class BatchLayout:
    """How one pass groups sequences into micro-batches; passes > 1 may vary it to expose batch variance."""

    micro_batch: int
    shuffle_seed: int | None = None
    extra_padding: int = 0

    @staticmethod
    def for_pass(pass_index: int, micro_batch: int, vary: bool) -> BatchLayout:
        if not vary or pass_index == 1:
            return BatchLayout(micro_batch=micro_batch)
        sizes = [max(1, micro_batch // 2), micro_batch * 2, max(1, micro_batch - 1)]
        return BatchLayout(
            micro_batch=sizes[(pass_index - 2) % 3], shuffle_seed=pass_index, extra_padding=5 * (pass_index - 1)
        )

    def micro_batches(self, requests: list[ScoreRequest]) -> list[list[ScoreRequest]]:
        order = np.arange(len(requests))
        if self.shuffle_seed is not None:
            order = np.random.default_rng(self.shuffle_seed).permutation(len(requests))
        ordered = [requests[i] for i in order]
        return [ordered[i : i + self.micro_batch] for i in range(0, len(ordered), self.micro_batch)]


@dataclass(frozen=True, kw_only=True)
class RescorePlan:
    """A checked rescore with its output folders ready: everything the scoring loop needs but the engine, so that
    one loaded engine can score several plans (`probe sweep`)."""

    job: RescoreJob
    run: Run
    manifest: RolloutManifest
    model: ModelInfo
    names: list[str]
    base: str
    truncation: Truncation | None
    weights: str | None
    writer: bool


def run_rescore(job: RescoreJob) -> list[str]:
    # The score-set folders are made once the engine has loaded: a load that fails (out of memory, a missing
    # weight) leaves no folder behind, and a set --overwrite would replace is kept.
    if is_prefill(job.engine):  # the inference engine's own prefill: the rollout's server, named ENGINE-prefill
        job = prefill_job(job, Run(job.run).manifest())
    elif not job.config.dtype:  # --dtype not given
        job = replace(job, config=replace(job.config, dtype=FP32))
    plan = prepare_rescore(job, make_folders=False)
    engine = training_engine(job.engine, plan.model, job.config, command=f"rescore {plan.base}")
    try:
        make_score_folders(plan)
        names = score_with(plan, engine)
    finally:
        engine.close()
    return names


def _outputs(job: RescoreJob, run: Run, names: list[str]) -> list[tuple]:
    return [(run.score_dir(name), job.resume, job.overwrite, f"score set '{name}'", SCORE_LAYOUT) for name in names]


def make_score_folders(plan: RescorePlan) -> None:
    """Each pass's folder ready to write: new, cleared (--overwrite) or kept (--resume)."""
    if plan.writer:
        for output in _outputs(plan.job, plan.run, plan.names):
            prepare_output(*output)


def prepare_rescore(
    job: RescoreJob, weights_of: Callable[[Path], str | None] = weights_sha256, make_folders: bool = True
) -> RescorePlan:
    """Check the job against the run and (`make_folders`) make its score-set folders ready (replaced, resumed or
    new). `weights_of` hashes the checkpoint's weight files; a caller scoring one checkpoint many times passes a
    cached one."""
    run = Run(job.run)
    manifest = run.manifest()
    shape = manifest.routing
    if job.replay not in REPLAYS:
        raise ProbeError(f"--replay: '{job.replay}' is not one of {', '.join(REPLAYS)}")
    if job.replays and not shape.is_moe:
        raise ProbeError(f"{run.manifest_path}: --replay r3 needs an MoE rollout, but this model is dense")
    check_policy_options(job.old, job.replay, job.policy_step, job.router_logprobs, shape.is_moe)
    if job.repeats < 1:
        raise ProbeError("--repeats must be at least 1")
    require_engine(job.engine)
    manifest.check_finished(run.manifest_path)
    manifest.check_scoring_temperature(run.manifest_path)
    if job.sampling not in SCORE_SAMPLINGS:
        raise ProbeError(f"--sampling: '{job.sampling}' is not one of {', '.join(SCORE_SAMPLINGS)}")
    truncation = rollout_truncation(manifest, run.manifest_path) if job.sampling == ROLLOUT_SAMPLING else None
    for part in require_parts(run.rollout_dir):  # footers and schemas now, not after hours of scoring
        open_part(part, shape)
    if job.old is not None:
        check_old_set(run, job.old, job.engine, job.config.dtype, job.replay)
    model = load_model_info(job.model or manifest.model, job.trust_remote_code, job.moe_family)
    manifest.check_model(model, new_policy=job.old is not None)
    if job.router_logprobs:
        check_router_logprobs(job.engine, model)
    base = job.name or default_score_name(job.engine, job.config.dtype, job.replay, job.policy_step, job.old)
    if base in ("", ".", "..") or Path(base).name != base:  # a score set lives in RUN/scores/, never elsewhere
        raise ProbeError(f"--name {base!r}: expected a plain folder name (no '/' or '..')")
    names = pass_names(base, job.repeats)
    writer = is_writer_rank()
    if writer:
        for output in _outputs(job, run, names):  # every pass's folder checked before any is replaced
            check_output(*output)
    plan = RescorePlan(
        job=job,
        run=run,
        manifest=manifest,
        model=model,
        names=names,
        base=base,
        truncation=truncation,
        weights=weights_of(model.path),
        writer=writer,
    )
    if make_folders:
        make_score_folders(plan)
    return plan


def score_with(plan: RescorePlan, engine: TrainingEngine) -> list[str]:
    """Score every pass of `plan` with `engine`, built (or reconfigured) for the plan's engine, dtype and options;
    the caller closes the engine."""
    job, run, manifest, truncation, writer = plan.job, plan.run, plan.manifest, plan.truncation, plan.writer
    shape = manifest.routing
    temperature = float(manifest.scoring_temperature)
    steps = step_ranges(manifest, str(run.manifest_path))
    schema = token_schema(
        shape,
        with_router_margin=engine.writes_router_margin,
        with_step=steps is not None,
        with_expert_logprobs=job.router_logprobs,
        with_expert_logprobs_at_old=job.router_logprobs and job.old is not None,
        with_kept_logmass=truncation is not None,
    )
    rollout_parts = len(part_files(run.rollout_dir))
    for pass_index, name in enumerate(plan.names, 1):
        layout = BatchLayout.for_pass(pass_index, job.config.batch_size, job.vary_batching)
        out_dir = run.score_dir(name)
        side_manifest = _side_manifest(
            job, engine, name, plan.base, pass_index, layout, temperature, manifest, plan.weights
        )
        side_manifest.sampling = score_sampling(temperature, truncation)
        mark_prefill(side_manifest, engine)
        if job.resume and (out_dir / MANIFEST).is_file():
            earlier = run.score_manifest(name)
            side_manifest.created_at, side_manifest.tokens_per_second = earlier.created_at, earlier.tokens_per_second
        if writer:
            side_manifest.save(out_dir / MANIFEST)
        options = ScoreOptions(
            temperature=temperature,
            extra_padding=layout.extra_padding,
            router_logprobs=job.router_logprobs,
            truncation=truncation,
        )
        tokens, started, speed = 0, time.perf_counter(), ForwardSpeed()
        with progress_bar() as bar:
            task = bar.add_task(f"rescore {name}", total=rollout_parts, unit="parts")
            for part, requests in iter_score_requests(run.rollout_dir, shape, with_experts=job.replays):
                if (out_dir / part).is_file():  # finished by an earlier, interrupted run
                    bar.advance(task)
                    continue
                if job.old is not None:  # R2's experts, and those whose router log-probs the shift reads
                    replay_old, probe = job.replay == R2, job.router_logprobs
                    attach_old_experts(requests, run.score_dir(job.old), part, shape, replay_old, probe)
                batches = layout.micro_batches(requests)
                records = unless_out_of_memory(_score_part, engine, batches, options, speed, run.rollout_dir / part)
                if records is None:  # out of memory: raised here, where the failed batch's tensors are gone
                    raise _stopped(plan, side_manifest, out_dir, part, speed, rollout_parts)
                if writer:
                    label_steps(records, steps)
                    write_part(out_dir, records, schema, shape)
                tokens += sum(len(r) for r in requests)
                bar.advance(task)
        side_manifest.status = COMPLETE
        mark_prefill(side_manifest, engine)
        elapsed = time.perf_counter() - started
        if speed.tokens_per_second is not None:  # a resumed pass that scored nothing keeps the earlier speed
            side_manifest.tokens_per_second = speed.tokens_per_second
        if writer:
            if truncation is not None:
                side_manifest.n_outside_support = outside_support(out_dir)
                console.print(f"{side_manifest.n_outside_support} sampled tokens outside this side's own support")
            side_manifest.save(out_dir / MANIFEST)
        console.print(
            f"scored {tokens} tokens in {elapsed:.1f}s ({tokens / max(elapsed, 1e-9):.0f} tok/s) -> {out_dir}"
        )
    return plan.names


def _score_part(engine, micro_batches, options: ScoreOptions, speed, part: Path) -> list:
    try:
        return speed.score(engine, micro_batches, options)
    except ProbeError as err:  # the engine names the sample; say which rollout file holds it
        raise ProbeError(f"{part}: {err}") from err


def _stopped(plan: RescorePlan, side_manifest, out_dir: Path, part: str, speed, parts: int) -> OutOfMemory:
    """Out of memory in a batch: the parts written are kept, the manifest says where the pass stopped (its status
    stays unfinished, so --resume continues from there), and the error is one line naming what would fit."""
    done = len(part_files(out_dir))
    kept = f"{done} of {parts} parts are kept and {out_dir / MANIFEST} says incomplete"
    ctx = context(f"rescore {out_dir.name}", plan.job.engine, plan.model, plan.job.config)
    line = batch_line(ctx, f"{plan.run.rollout_dir / part}", speed.failed or (0, 0, 0), kept)
    side_manifest.incomplete = {"stopped_at": part, "parts_done": done, "parts": parts, "why": line}
    if plan.writer:
        side_manifest.save(out_dir / MANIFEST)
    return OutOfMemory(line)


class ForwardSpeed:
    """Tokens per second of the engine's forwards, the cost `probe sweep` compares between configurations: the
    time inside `engine.score` only (not reading and writing Parquet), and without a set's first micro-batch where
    it has more, since that one pays the warm-up (allocator, lazy kernels, a just-switched knob's first call)."""

    def __init__(self) -> None:
        self.timed: list[tuple[int, float]] = []  # (tokens, seconds) per micro-batch
        self.failed: tuple[int, int, int] | None = None  # (sequences, tokens, width) of the micro-batch being scored

    def score(self, engine, micro_batches: list[list[ScoreRequest]], options: ScoreOptions) -> list:
        records = []
        for mb in micro_batches:
            started = time.perf_counter()
            self.failed = (len(mb), sum(len(r) for r in mb), max((len(r) for r in mb), default=0))
            records.extend(engine.score(mb, options))
            self.timed.append((sum(len(r) for r in mb), time.perf_counter() - started))
        return records

    @property
    def tokens_per_second(self) -> float | None:
        timed = self.timed[1:] if len(self.timed) > 1 else self.timed
        if not timed:
            return None
        return sum(t for t, _ in timed) / max(sum(s for _, s in timed), 1e-9)


def _side_manifest(job, engine, name, base, pass_index, layout, temperature, rollout, weights) -> ScoreManifest:
    return ScoreManifest.started(
        name=name,
        role=job.set_role,
        engine=engine.describe(),
        engine_options=resolved_options("training", job.engine, job.config.engine_args),
        dtype=job.config.dtype,
        quantization=engine.quantization(),
        replay=job.replay,
        temperature=temperature,
        repeat_group=base if job.repeats > 1 else None,
        pass_index=pass_index if job.repeats > 1 else None,
        repeats=job.repeats,
        batch_layout=asdict(layout),
        model=str(engine.model.path),
        config_hash=engine.model.config_hash,
        rollout_created_at=rollout.created_at,
        weights_sha256=weights,
        policy=None if job.policy is None else job.policy.manifest_entry(),
    )


def rollout_truncation(manifest: RolloutManifest, path: Path) -> Truncation:
    """`--sampling rollout`: the rollout's top-p and top-k (none under greedy decoding), from its manifest."""
    sampling = manifest.sampling if isinstance(manifest.sampling, dict) else {}
    for key in ("temperature", "top_p", "top_k"):
        if not isinstance(sampling.get(key), (int, float)) or isinstance(sampling.get(key), bool):
            raise ProbeError(f"{path}: --sampling rollout needs sampling.{key} in the rollout manifest (missing)")
    if sampling["temperature"] <= 0:
        return Truncation()
    return Truncation(top_p=float(sampling["top_p"]), top_k=int(sampling["top_k"]))


def score_sampling(temperature: float, truncation: Truncation | None) -> dict:
    """A score set's own `sampling` entry."""
    if truncation is None:
        return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "logprobs_mode": RAW}
    return {
        "temperature": temperature,
        "top_p": truncation.top_p,
        "top_k": truncation.top_k,
        "logprobs_mode": PROCESSED,
    }


def outside_support(out_dir: Path) -> int:
    """Scored tokens (kept_logmass known) whose log-prob is null: outside this side's own support."""
    count = 0
    for part in part_files(out_dir):
        table = pq.read_table(part, columns=["logprob", KEPT_LOGMASS])
        known = table.column(KEPT_LOGMASS).is_valid().to_numpy(zero_copy_only=False)
        null = table.column("logprob").is_null().to_numpy(zero_copy_only=False)
        count += int((known & null).sum())
    return count
