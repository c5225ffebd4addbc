"""`probe rescore`: push the rollout's stored token ids through a training engine."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .engines import training_engine
from .engines.base import EngineConfig, ScoreOptions
from .errors import ProbeError
from .extras import require_engine
from .modelinfo import ModelInfo, check_matches_manifest, load_model_info
from .progress import console, progress_bar
from .records import ScoreRequest
from .run import MANIFEST, Run, now_iso, package_versions, read_json, routing_shape, write_json_atomic
from .rundir import prepare_output
from .schema import SCHEMA_VERSION, token_schema
from .table_io import iter_score_requests, open_part, part_files, require_parts, write_part


@dataclass(frozen=True)
class RescoreJob:
    run: Path
    engine: str
    config: EngineConfig
    model: Path | None = None
    replay: str = "none"
    repeats: int = 1
    vary_batching: bool = False
    name: str | None = None
    resume: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class BatchLayout:
    """How one pass groups sequences into micro-batches; passes > 1 may vary it to expose batch variance."""

    micro_batch: int
    shuffle_seed: int | None = None
    extra_padding: int = 0

    @staticmethod
    def for_pass(pass_index: int, micro_batch: int, vary: bool) -> "BatchLayout":
        if not vary or pass_index == 1:
            return BatchLayout(micro_batch)
        sizes = [max(1, micro_batch // 2), micro_batch * 2, max(1, micro_batch - 1)]
        return BatchLayout(sizes[(pass_index - 2) % 3], shuffle_seed=pass_index, extra_padding=5 * (pass_index - 1))

    def micro_batches(self, requests: list[ScoreRequest]) -> list[list[ScoreRequest]]:
        order = np.arange(len(requests))
        if self.shuffle_seed is not None:
            order = np.random.default_rng(self.shuffle_seed).permutation(len(requests))
        ordered = [requests[i] for i in order]
        return [ordered[i : i + self.micro_batch] for i in range(0, len(ordered), self.micro_batch)]


def default_name(engine: str, dtype: str, replay: str) -> str:
    return f"{engine}-{dtype}" + ("-r3" if replay == "r3" else "")


def check_model_matches(model: ModelInfo, manifest: dict) -> None:
    """The training model must be the rollout's: the same routing shape, then the same config."""
    check_matches_manifest(model, manifest, where=f"{model.path}/config.json vs the rollout manifest")
    if model.config_hash != manifest.get("config_hash"):
        raise ProbeError(
            f"{model.path}/config.json: config hash {model.config_hash} differs from the rollout manifest's "
            f"{manifest.get('config_hash')} (model {manifest.get('model')})"
        )


def is_writer_rank() -> bool:
    """Under torchrun every rank runs the same forwards; only rank 0 writes files."""
    return int(os.environ.get("RANK", "0")) == 0


def check_rollout_manifest(run: Run, manifest: dict) -> None:
    """A rescore needs a finished rollout and the fields it scores with."""
    if manifest.get("status") == "running":
        raise ProbeError(
            f"{run.manifest_path}: the rollout is unfinished (status 'running'); finish it with `probe generate ... --resume`"
        )
    for key in ("model", "config_hash", "scoring_temperature"):
        if key not in manifest:
            raise ProbeError(f"{run.manifest_path}: missing '{key}' (expected a rollout manifest written by `probe generate`)")
    temperature = manifest["scoring_temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ProbeError(f"{run.manifest_path}: scoring_temperature is {temperature!r}, expected a number > 0")


def run_rescore(job: RescoreJob) -> list[str]:
    run = Run(job.run)
    manifest = run.manifest()
    shape = routing_shape(manifest)
    if job.replay not in ("none", "r3"):
        raise ProbeError(f"--replay: '{job.replay}' is not one of none, r3")
    if job.replay == "r3" and not shape.is_moe:
        raise ProbeError(f"{run.manifest_path}: --replay r3 needs an MoE rollout, but this model is dense")
    if job.repeats < 1:
        raise ProbeError("--repeats must be at least 1")
    require_engine(job.engine)
    check_rollout_manifest(run, manifest)
    for part in require_parts(run.rollout_dir):  # footers and schemas now, not after hours of scoring
        open_part(part, shape)
    model = load_model_info(job.model or manifest["model"])
    check_model_matches(model, manifest)
    base = job.name or default_name(job.engine, job.config.dtype, job.replay)
    names = [base] if job.repeats == 1 else [f"{base}-pass{i}" for i in range(1, job.repeats + 1)]
    writer = is_writer_rank()
    for name in names:
        if writer:
            prepare_output(run.score_dir(name), job.resume, job.overwrite, f"score set '{name}'")

    engine = training_engine(job.engine, model, job.config)
    temperature = float(manifest["scoring_temperature"])
    schema = token_schema(shape)
    rollout_parts = len(part_files(run.rollout_dir))
    for pass_index, name in enumerate(names, 1):
        layout = BatchLayout.for_pass(pass_index, job.config.batch_size, job.vary_batching)
        out_dir = run.score_dir(name)
        side_manifest = _side_manifest(job, engine, name, base, pass_index, layout, temperature, manifest)
        if job.resume and (out_dir / MANIFEST).is_file():
            side_manifest["created_at"] = read_json(out_dir / MANIFEST)["created_at"]
        if writer:
            write_json_atomic(out_dir / MANIFEST, side_manifest)
        options = ScoreOptions(temperature=temperature, replay=job.replay, extra_padding=layout.extra_padding)
        tokens, started = 0, time.perf_counter()
        with progress_bar() as bar:
            task = bar.add_task(f"rescore {name}", total=rollout_parts, unit="parts")
            for part, requests in iter_score_requests(run.rollout_dir, shape, with_experts=job.replay == "r3"):
                if (out_dir / part).is_file():  # finished by an earlier, interrupted run
                    bar.advance(task)
                    continue
                records = [rec for mb in layout.micro_batches(requests) for rec in engine.score(mb, options)]
                if writer:
                    write_part(out_dir, records, schema, shape)
                tokens += sum(len(r) for r in requests)
                bar.advance(task)
        side_manifest["status"] = "complete"
        if writer:
            write_json_atomic(out_dir / MANIFEST, side_manifest)
        elapsed = time.perf_counter() - started
        console.print(f"scored {tokens} tokens in {elapsed:.1f}s ({tokens / max(elapsed, 1e-9):.0f} tok/s) -> {out_dir}")
    engine.close()
    return names


def _side_manifest(job, engine, name, base, pass_index, layout, temperature, rollout) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "created_at": now_iso(),
        "status": "running",
        "engine": engine.describe(),
        "dtype": job.config.dtype,
        "replay": job.replay,
        "temperature": temperature,
        "repeat_group": base if job.repeats > 1 else None,
        "pass_index": pass_index if job.repeats > 1 else None,
        "repeats": job.repeats,
        "batch_layout": asdict(layout),
        "model": str(engine.model.path),
        "config_hash": engine.model.config_hash,
        "rollout_created_at": rollout.get("created_at"),
        "versions": package_versions(),
    }
