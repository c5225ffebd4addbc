"""A real tiny policy run for the staleness tests: the demo MoE model's rollout, its θ_old passes (replay none
and R3, with router log-probs) and a new checkpoint whose routers alone are perturbed, scored natural, R2 and R3,
plus R2 at the rollout's own checkpoint (step 0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.pipeline.generate import GenerateJob, run_generate
from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
from mismatch_probe.vocab import FP32, NO_REPLAY, R2, R3

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def router_perturbed(model: Path, out: Path, scale: float = 0.05, seed: int = 0) -> Path:
    """A checkpoint whose router weights only get Gaussian noise of `scale` times their std: the routes move,
    the rest of the model does not (so under R2 the new pass differs from θ_old only through routing)."""
    hf = AutoModelForCausalLM.from_pretrained(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                weight.add_(scale * weight.std() * torch.randn(weight.shape, generator=generator))
    hf.save_pretrained(out)
    for name in SIDE_FILES:
        if (model / name).is_file():
            shutil.copy(model / name, out / name)
    return out


def make_policy_run(root: Path, model: Path, prompts: Path, new: Path, num_prompts: int = 8) -> Path:
    run = root / "run"
    run_generate(
        GenerateJob(
            model=model,
            prompts=prompts,
            out=run,
            engine="hf",
            params=SamplingParams(temperature=1.0, max_new_tokens=20, seed=0),
            config=EngineConfig(dtype="bf16", batch_size=16),
            samples_per_prompt=3,
            num_prompts=num_prompts,
        )
    )
    score_policy_passes(run, "hf", model, new, router_logprobs=True)
    return run


def score_policy_passes(run: Path, engine: str, model: Path, new: Path, router_logprobs: bool) -> None:
    """θ_old (replay none and R3), θ_new natural, R2 and R3 at step 1, and R2 at the rollout's checkpoint (step 0)."""
    config = EngineConfig(dtype=FP32, batch_size=8)
    old = f"{engine}-fp32"

    def rescore(**job) -> None:
        run_rescore(RescoreJob(run=run, engine=engine, config=config, router_logprobs=router_logprobs, **job))

    rescore(replay=NO_REPLAY)
    rescore(replay=R3)
    rescore(model=new, old=old, policy_step=1, replay=NO_REPLAY)
    rescore(model=new, old=old, policy_step=1, replay=R2)
    rescore(model=new, old=f"{old}-r3", policy_step=1, replay=R3)
    rescore(model=model, old=old, policy_step=0, replay=R2)
