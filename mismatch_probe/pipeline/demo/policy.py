"""The demo's policy staleness: new checkpoints θ_new made from the demo MoE model by policy-gradient steps on
its own rollout (pipeline/demo/policy_steps.py), each scored natural, R2 and R3 against the θ_old passes, and at
step 0 (θ_new = θ_old) R2 and R3 alone (the natural pass there is the θ_old set itself). docs/staleness.md."""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.pipeline.demo.clock import StepClock
from mismatch_probe.pipeline.demo.policy_steps import make_policy_checkpoints
from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
from mismatch_probe.progress import console
from mismatch_probe.rundir.layout import default_score_name
from mismatch_probe.vocab import FP32, NO_REPLAY, R2, R3

POLICY_STEPS = (1, 2, 4, 8)
POLICY_DTYPE = FP32  # the fp32 hf training side, as SPEC section 7b measured it
CHECKPOINTS = "policy-checkpoints"
# The θ_old sets each replay pairs with: the demo's plain and R3 hf fp32 passes, scored with router log-probs.
OLD_SETS = {
    replay: default_score_name("hf", POLICY_DTYPE, R3 if replay == R3 else NO_REPLAY) for replay in (NO_REPLAY, R2, R3)
}


def policy_passes(run: Path, model: Path, out: Path, batch_size: int, clock: StepClock | None = None) -> list[str]:
    """Make the checkpoints under `out/policy-checkpoints/`, then score every (step, replay) pass into `run`."""
    console.rule("[bold]policy staleness: new checkpoints by policy-gradient steps on the demo's own rollout")
    clock = clock or StepClock()
    with clock.step("moe: policy checkpoints"):
        checkpoints = {0: model} | make_policy_checkpoints(run, model, out / CHECKPOINTS, steps=POLICY_STEPS)
    config = EngineConfig(dtype=POLICY_DTYPE, batch_size=batch_size)
    names = []
    for step, checkpoint in checkpoints.items():
        for replay in (NO_REPLAY, R2, R3) if step else (R2, R3):
            job = RescoreJob(
                run=run,
                engine="hf",
                config=config,
                model=checkpoint,
                replay=replay,
                old=OLD_SETS[replay],
                policy_step=step,
                router_logprobs=True,
                overwrite=True,
            )
            with clock.step(f"moe: policy pass step {step} {replay}"):
                names += run_rescore(job)
    return names
