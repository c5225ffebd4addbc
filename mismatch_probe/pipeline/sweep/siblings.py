"""Sibling runs: a new rollout of RUN's prompts with RUN's sampling and seeds, one knob changed on the inference
engine, in a folder next to RUN (`RUN+rollout.KNOB-VALUE`).

The prompts are the token ids RUN's rollout stored, not its prompts file read again: the sibling samples from
exactly the ids RUN sampled from, with no re-tokenization, even where the prompts file has moved or changed
since; its manifest records RUN's prompts_file and prompts_sha256, the source both runs share.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.engines import resolved_options
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline.generate import GenerateJob, StoredPrompts, run_generate
from mismatch_probe.pipeline.sweep.knobs import Knob, Setting
from mismatch_probe.pipeline.sweep.state import ABSENT, RESUME, REUSE, rollout_state
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.manifests import RolloutManifest
from mismatch_probe.rundir.parts import part_files, read_part

ROLLOUT_ENGINE = "hf"  # the one inference engine a sweep samples with in process
PROMPT_COLUMNS = ["sample_id", "prompt_id", "position", "token_id", "is_response"]


def sibling_path(run: Run, knob: Knob) -> Path:
    return run.root.parent / f"{run.root.name}+rollout.{knob.label}"


def rollout_setting(manifest: RolloutManifest, path: Path) -> Setting:
    """The dtype and engine options RUN's rollout was sampled with."""
    options = manifest.engine_options
    if options is None and manifest.quantization:  # written before manifests recorded engine options
        raise ProbeError(
            f"{path}: records no engine_options for its quantized rollout; rollout-side variants cannot rebuild it "
            "(generate the run again with this probe)"
        )
    return Setting(dtype=manifest.dtype, engine_args=dict(options or {}))


def same_rollout(manifest: RolloutManifest, setting: Setting) -> bool:
    """`setting` samples exactly as RUN's rollout did: the variant is RUN itself."""
    current = Setting(dtype=manifest.dtype, engine_args=dict(manifest.engine_options or {}))
    return current.resolved("inference", ROLLOUT_ENGINE) == setting.resolved("inference", ROLLOUT_ENGINE)


def stored_prompts(run: Run, manifest: RolloutManifest) -> StoredPrompts:
    """Each prompt's token ids as RUN's rollout stored them (its first sample's prompt positions)."""
    tables = []
    for part in part_files(run.rollout_dir):
        table = read_part(part, PROMPT_COLUMNS)
        tables.append(table.filter(pc.invert(table.column("is_response"))))
    frame = pl.from_arrow(pa.concat_tables(tables)) if tables else pl.DataFrame()
    if frame.is_empty():
        raise ProbeError(f"{run.rollout_dir}: holds no prompt tokens; rollout-side variants resample its prompts")
    first = frame.filter(pl.col("sample_id") == pl.col("sample_id").min().over("prompt_id"))
    prompts = (
        first.sort("prompt_id", "position")
        .group_by("prompt_id", maintain_order=True)
        .agg(pl.col("token_id"), pl.col("position").min().alias("lo"), pl.col("position").max().alias("hi"))
        .with_columns(pl.col("token_id").list.len().alias("n"))
    )
    expected = manifest.num_prompts if manifest.num_prompts is not None else prompts.height
    if prompts["prompt_id"].to_list() != list(range(expected)):
        raise ProbeError(
            f"{run.rollout_dir}: stores prompts {prompts['prompt_id'].min()}..{prompts['prompt_id'].max()} "
            f"({prompts.height} in all), the manifest's num_prompts is {expected}"
        )
    gaps = prompts.filter((pl.col("lo") != 0) | (pl.col("hi") != pl.col("n") - 1))
    if gaps.height:
        raise ProbeError(f"{run.rollout_dir}: prompt {gaps['prompt_id'][0]}'s tokens are not all stored")
    ids = [[int(t) for t in row] for row in prompts["token_id"].to_list()]
    return StoredPrompts(ids=ids, file=manifest.prompts_file or "", sha256=manifest.prompts_sha256)


def sibling_job(run: Run, manifest: RolloutManifest, setting: Setting, out: Path, **flags) -> GenerateJob:
    """The `probe generate` that makes the sibling: RUN's model, sampling, seed and counts, with `setting`."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(**{k: v for k, v in (manifest.sampling or {}).items() if k in known})
    return GenerateJob(
        model=Path(manifest.model),
        prompts=Path(manifest.prompts_file or "prompts.jsonl"),
        out=out,
        engine=ROLLOUT_ENGINE,
        params=params,
        config=EngineConfig(dtype=setting.dtype, batch_size=manifest.batch_size or 16, engine_args=setting.engine_args),
        samples_per_prompt=manifest.samples_per_prompt or 1,
        num_prompts=manifest.num_prompts,
        **flags,
    )


def sibling_wanted(manifest: RolloutManifest, job: GenerateJob) -> dict:
    """The rollout-manifest values the sibling must hold to be reused or resumed."""
    return {
        "engine": ROLLOUT_ENGINE,
        "dtype": job.config.dtype,
        "engine_options": resolved_options("inference", ROLLOUT_ENGINE, job.config.engine_args),
        "sampling": job.params.to_dict(),
        "seed": job.params.seed,
        "prompts_sha256": manifest.prompts_sha256,
        "num_prompts": manifest.num_prompts,
        "samples_per_prompt": job.samples_per_prompt,
        "num_samples": manifest.num_samples,
        "batch_size": job.config.batch_size,
        "config_hash": manifest.config_hash,
    }


def ensure_sibling(run: Run, manifest: RolloutManifest, setting: Setting, out: Path, overwrite: bool, **flags) -> str:
    """Make, resume or reuse the sibling run at `out`; what was done (generated, resumed or reused)."""
    job = sibling_job(run, manifest, setting, out, **flags)
    state = rollout_state(out, sibling_wanted(manifest, job))
    if state.kind == REUSE:
        return "reused"
    if state.kind not in (ABSENT, RESUME) and not overwrite:
        raise state.refuse("the sibling run", out)
    job = dataclasses.replace(job, resume=state.kind == RESUME, overwrite=state.kind not in (ABSENT, RESUME))
    run_generate(job, stored_prompts(run, manifest))
    return "resumed" if state.kind == RESUME else "generated"
