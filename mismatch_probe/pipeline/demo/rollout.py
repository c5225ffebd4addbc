"""One demo rollout: the hf engine sampling the demo prompts into a run, replacing an earlier demo's."""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.pipeline.generate import GenerateJob, run_generate


def demo_rollout(
    *,
    model: Path,
    prompts: Path,
    run: Path,
    params: SamplingParams,
    config: EngineConfig,
    samples: int,
    prompt_count: int,
) -> None:
    run_generate(
        GenerateJob(
            model=model,
            prompts=prompts,
            out=run,
            engine="hf",
            params=params,
            config=config,
            samples_per_prompt=samples,
            num_prompts=prompt_count,
            overwrite=True,
        )
    )
