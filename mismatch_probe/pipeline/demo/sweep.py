"""`probe demo`'s sweep of the MoE model (`probe sweep`, docs/remedies.md#sweep): a bf16 hf rollout of its own,
scored by a bf16 hf base and by variants of it, each changing one knob (pipeline/sweep/), then its report,
whose `remedies` give each variant's k3 over the base's with an interval (report/verdict/remedies.py). The
effects table states each measured variant's ratio and whether its interval excludes 1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.pipeline.demo.clock import StepClock
from mismatch_probe.pipeline.demo.rollout import demo_rollout
from mismatch_probe.pipeline.sweep.plan import SweepJob
from mismatch_probe.pipeline.sweep.run import run_sweep
from mismatch_probe.progress import console
from mismatch_probe.report.build import build_report
from mismatch_probe.rundir.layout import RUN_LAYOUT, default_score_name
from mismatch_probe.rundir.ownership import clear
from mismatch_probe.rundir.sweep import TRAINING_SIDE
from mismatch_probe.vocab import BF16, NO_REPLAY

SWEEP_RUN = "moe-sweep"  # its run folder in the demo's --out
# Its sibling runs (pipeline/sweep/siblings.py names them RUN+rollout.KNOB-VALUE), one per rollout-side knob.
SWEEP_SIBLINGS = f"{SWEEP_RUN}+rollout.*"
SWEEP_BASE = default_score_name("hf", BF16, NO_REPLAY)  # the base's score set: hf-bf16
# The first 256 demo prompts, each sampled 4 times (about 20,000 response tokens a run): fewer leave the bf16
# base's k3 to one or two sequences whose routing flipped (at 2 samples a prompt its interval spanned 10×), and
# more would cost the demo more than the half minute these runs take on 2 idle cores.
SWEEP_PROMPTS = 256
SWEEP_SAMPLES = 4


@dataclass(frozen=True)
class SweepRow:
    """A variant of the demo's sweep with its row in the effects table."""

    name: str  # how the effects table and the README's sentence name it
    vary: str  # its `probe sweep --vary`
    # The label's expectation: a remedy lowers k3 (the base is the higher side); a knob that makes the training
    # side compute otherwise than the rollout raises it (the variant is the higher side).
    raises: bool = False

    @property
    def side(self) -> str:
        side, colon, _ = self.vary.partition("=")[0].rpartition(":")
        return side if colon else TRAINING_SIDE

    @property
    def changed(self) -> dict:
        key, _, value = self.vary.rpartition(":")[2].partition("=")
        return {key: value}


SWEEP_ROWS = (
    SweepRow(name="fp32 lm_head on both sides", vary="both:lm_head_dtype=fp32"),
    SweepRow(name="fp32 router on both sides", vary="both:router_dtype=fp32"),
    # The rollout decodes with transformers' default, sdpa: eager attention in training is another kernel.
    SweepRow(name="eager attention in training, sdpa rollout", vary="attn_implementation=eager", raises=True),
)
# sdpa, the hf default, resolves to the base: the sweep records it as the base's score set and scores nothing.
SAME_AS_BASE_VARY = "attn_implementation=sdpa"
SWEEP_VARY = (*(row.vary for row in SWEEP_ROWS), SAME_AS_BASE_VARY)


def sweep_run(
    out: Path,
    model: Path,
    prompts: Path,
    num_prompts: int,
    max_new_tokens: int,
    *,
    temperature: float,
    batches,
    clock: StepClock | None = None,
) -> dict[str, dict]:
    """The sweep's rollout, the sweep and the report: {run name: metrics.json}."""
    generate_batch, rescore_batch = batches
    console.rule(f"[bold]sweep {SWEEP_RUN}: {', '.join(SWEEP_VARY)}")
    run = out / SWEEP_RUN
    clock = clock or StepClock()
    with clock.step(f"{SWEEP_RUN}: generate"):
        demo_rollout(
            model=model,
            prompts=prompts,
            run=run,
            params=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=0),
            config=EngineConfig(dtype=BF16, batch_size=generate_batch),
            samples=SWEEP_SAMPLES,
            prompt_count=min(num_prompts, SWEEP_PROMPTS),
        )
    # A previous demo's sibling runs would be reused as the same rollout: removed, so the demo redoes them.
    for sibling in sorted(out.glob(SWEEP_SIBLINGS)):
        clear(sibling, RUN_LAYOUT)
        sibling.rmdir()
    job = SweepJob(run=run, engine="hf", config=EngineConfig(dtype=BF16, batch_size=rescore_batch), vary=SWEEP_VARY)
    with clock.step(f"{SWEEP_RUN}: sweep (base, variants, rollout-side siblings)"):
        run_sweep(job)
    with clock.step(f"{SWEEP_RUN}: report"):
        return {SWEEP_RUN: build_report(run).metrics}
