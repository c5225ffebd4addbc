"""`probe demo`: the whole pipeline on the shipped tiny trained models, MoE and its dense twin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.extras import ENGINE_EXTRAS, engine_installed
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json, write_json_atomic
from mismatch_probe.pipeline.demo.beside import BesideProcess, threads_per_process, torch_threads
from mismatch_probe.pipeline.demo.clock import StepClock
from mismatch_probe.pipeline.demo.effects import effects, effects_table, sweep_sentence
from mismatch_probe.pipeline.demo.handoff import MOE_PASSES, MOE_ROLLOUT, Handoff
from mismatch_probe.pipeline.demo.policy import CHECKPOINTS, policy_passes
from mismatch_probe.pipeline.demo.policy_steps import CHECKPOINTS_LAYOUT
from mismatch_probe.pipeline.demo.production import PRODUCTION_RUNS, production_runs
from mismatch_probe.pipeline.demo.rollout import demo_rollout
from mismatch_probe.pipeline.demo.sweep import SWEEP_RUN, SWEEP_SIBLINGS, sweep_run
from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
from mismatch_probe.progress import console
from mismatch_probe.report.build import build_report
from mismatch_probe.report.keys.catalogue import checked
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.numbers import value
from mismatch_probe.rundir.layout import RUN_LAYOUT, default_score_name
from mismatch_probe.rundir.ownership import Entry, Layout, json_with, named_files, refuse_foreign
from mismatch_probe.vocab import BF16, FP32, NO_REPLAY, R3, Replay

# Package data; pip installs packages as directories, and transformers loads models from a path.
DATA = Path(str(files("mismatch_probe").joinpath("data")))


@dataclass(frozen=True)
class Rescore:
    engine: str
    dtype: str
    replay: Replay = NO_REPLAY
    repeats: int = 1
    name: str | None = None
    moe_only: bool = False
    router_logprobs: bool = False  # on the MoE model: the θ_old sets the policy passes pair with (policy.py)
    beside: bool = False  # on the MoE model: run in the second process (beside.py), to even the two out


# Reference: bf16 KV-cache decode. The training side in fp32 and bf16, with and without R3,
# repeated passes with varied batching, in both training engines.
PLAN = (
    Rescore(engine="hf", dtype=FP32, router_logprobs=True),
    Rescore(engine="hf", dtype=BF16),
    Rescore(engine="hf", dtype=BF16, replay=R3, moe_only=True),
    Rescore(engine="hf", dtype=FP32, replay=R3, moe_only=True, router_logprobs=True),
    Rescore(engine="hf", dtype=BF16, repeats=2, name="hf-bf16-rep", beside=True),
    Rescore(engine="megatron", dtype=FP32, beside=True),
    Rescore(engine="megatron", dtype=BF16, beside=True),
    Rescore(engine="megatron", dtype=BF16, replay=R3, moe_only=True, beside=True),
)
# Engine against engine on identical inputs: fp32 should agree, bf16 should not.
ENGINE_PAIRS = (("scores/hf-fp32", "scores/megatron-fp32"), ("scores/hf-bf16", "scores/megatron-bf16"))
# Every prompt sampled 8 times, in large batches: enough tokens for the effects' intervals to separate,
# in a few minutes on 2 cores.
SAMPLES_PER_PROMPT = 8
GENERATE_BATCH = 128
RESCORE_BATCH = 32
# Sampling at T = 2 reaches the tokens the small models are unsure of, where bf16 rounding and routing
# flips move probabilities most: at T = 1 their answers are too confident for F(2) to rest on 20 tokens.
# Both sides score at this temperature (log_softmax(logits / T)), as the spec requires.
TEMPERATURE = 2.0
SUMMARY = "summary.json"
# What the demo writes into --out; it replaces a folder holding only these (or nothing), so a previous
# demo is redone but nothing of the user's is deleted.
DEMO_LAYOUT = Layout(
    what="a probe demo folder",
    entries=(
        Entry(pattern="moe", layout=RUN_LAYOUT),
        Entry(pattern="dense", layout=RUN_LAYOUT),
        *(Entry(pattern=p.name, layout=RUN_LAYOUT) for p in PRODUCTION_RUNS),
        Entry(pattern=SWEEP_RUN, layout=RUN_LAYOUT),
        Entry(pattern=SWEEP_SIBLINGS, layout=RUN_LAYOUT),
        Entry(pattern=CHECKPOINTS, layout=CHECKPOINTS_LAYOUT),
        Entry(pattern=SUMMARY, check=json_with("reference", "comparisons", "effects")),
        *named_files(f".{SUMMARY}.tmp"),
    ),
)
SUMMARY_KEYS = checked(
    "k3_kl",
    EXTREME_FRACTION.at(1.5),
    EXTREME_FRACTION.at(2),
    "abs_logprob_diff_max",
    "router_diff_rate",
    "token_diff_rate",
)


def run_demo(out: Path, models: Path, prompts: Path, num_prompts: int, max_new_tokens: int) -> dict:
    """The demo's sections, each its own runs in --out: the MoE model (with its policy passes) in this process,
    and beside it, in a second process (beside.py), its dense twin, the MoE model's `beside` passes, its
    production rollouts and its sweep; the effects table states what each shows."""
    refuse_foreign(out, DEMO_LAYOUT)  # before minutes of work, and before anything is replaced
    for kind in ("moe", "dense"):
        if not (models / kind / "config.json").is_file():
            raise ProbeError(f"{models / kind}: demo model not found (train it with scripts/train_demo_models.py)")
    plan, engine_pairs = _installed_plan()
    clock = StepClock()
    beside = BesideProcess.start(out, models, prompts, num_prompts, max_new_tokens)
    try:
        with torch_threads(threads_per_process()):
            run = rollout("moe", out, models, prompts, num_prompts, max_new_tokens, clock)
            beside.handoff.say(MOE_ROLLOUT)
            rescores("moe", run, [step for step in plan if not step.beside], clock)
            policy_passes(run, models / "moe", out, RESCORE_BATCH, clock=clock)
            if not beside.handoff.said(MOE_PASSES):  # its report reads the second process's passes too
                with clock.step("moe: wait for the second process's MoE passes"):
                    beside.wait_for(MOE_PASSES)
            results = {"moe": report("moe", run, engine_pairs, clock)}
        clock.beside = beside.wait()
    except BaseException:  # the first process failed or was interrupted (waiting too): the second goes with it
        beside.stop()
        raise
    results["dense"] = _metrics(out / "dense")
    production = {p.name: _metrics(out / p.name) for p in PRODUCTION_RUNS}
    sweep = {SWEEP_RUN: _metrics(out / SWEEP_RUN)}
    summary = _summary(results) | {"effects": effects(results | production | sweep), "wall_time": clock.as_dict()}
    write_json_atomic(out / SUMMARY, summary)
    _print_summary(summary, out, [*results, *production, *sweep])
    console.print(effects_table(summary["effects"]))
    console.print(sweep_sentence(summary["effects"]), highlight=False)
    console.print(clock.table())
    return summary


def beside_sections(
    out: Path,
    models: Path,
    prompts: Path,
    num_prompts: int,
    max_new_tokens: int,
    clock: StepClock,
    handoff: Handoff,
    first_alive: Callable[[], bool],
) -> None:
    """What the second process runs: the dense model's run; the MoE model's `beside` passes, once the first
    process has written its rollout (the first waits for them before its MoE report); the production rollouts
    and the sweep."""
    plan, engine_pairs = _installed_plan()
    run = rollout("dense", out, models, prompts, num_prompts, max_new_tokens, clock)
    rescores("dense", run, [step for step in plan if not step.moe_only], clock)
    report("dense", run, engine_pairs, clock)
    handoff.wait(MOE_ROLLOUT, first_alive, "the demo's first process (MoE model)")
    rescores("moe", out / "moe", [step for step in plan if step.beside], clock)
    handoff.say(MOE_PASSES)
    batches = (GENERATE_BATCH, RESCORE_BATCH)
    production_runs(out, models / "moe", prompts, num_prompts, max_new_tokens, batches=batches, clock=clock)
    sweep_run(
        out, models / "moe", prompts, num_prompts, max_new_tokens, temperature=TEMPERATURE, batches=batches, clock=clock
    )


def _metrics(run: Path) -> dict:
    return read_json(run / "report" / "metrics.json")


def rollout(
    kind: str, out: Path, models: Path, prompts: Path, num_prompts: int, max_new_tokens: int, clock: StepClock
) -> Path:
    """One model's rollout: its run folder, `out/KIND`."""
    model = models / kind
    console.rule(f"[bold]{kind} model: {model}")
    run = out / kind
    with clock.step(f"{kind}: generate"):
        demo_rollout(
            model=model,
            prompts=prompts,
            run=run,
            params=SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens, seed=0),
            config=EngineConfig(dtype=BF16, batch_size=GENERATE_BATCH),
            samples=SAMPLES_PER_PROMPT,
            prompt_count=num_prompts,
        )
    return run


def rescores(kind: str, run: Path, steps: list[Rescore], clock: StepClock) -> None:
    """These steps of the plan, scored into `run`."""
    for step in steps:
        config = EngineConfig(dtype=step.dtype, batch_size=RESCORE_BATCH)
        job = RescoreJob(
            run=run,
            engine=step.engine,
            config=config,
            replay=step.replay,
            repeats=step.repeats,
            vary_batching=step.repeats > 1,
            name=step.name,
            overwrite=True,
            router_logprobs=step.router_logprobs and kind == "moe",
        )
        with clock.step(f"{kind}: rescore {step.name or default_score_name(step.engine, step.dtype, step.replay)}"):
            run_rescore(job)


def report(kind: str, run: Path, engine_pairs: tuple, clock: StepClock) -> dict:
    """The run's report; its metrics. The engine pairs are added to the default pairs: the run remembers them,
    and a plain `probe report` reproduces the same comparisons."""
    with clock.step(f"{kind}: report"):
        return build_report(run, pairs=[f"+{a}:{b}" for a, b in engine_pairs]).metrics


def _installed_plan() -> tuple[tuple[Rescore, ...], tuple]:
    """Without the [megatron] extra the demo runs the transformers rescores only, and says so."""
    if engine_installed("megatron"):
        return PLAN, ENGINE_PAIRS
    console.print(
        escape(
            f"megatron-core is not installed: skipping the megatron rescores "
            f"({ENGINE_EXTRAS['megatron'].install_command()} adds them)"
        ),
        style="yellow",
    )
    return tuple(step for step in PLAN if step.engine != "megatron"), ()


def _summary(results: dict) -> dict:
    """The engine runs' comparisons, by score set and model (the production runs and the sweep state their
    effects in the effects table, and each its comparisons in its own report)."""
    rows = {}
    for kind, metrics in results.items():
        for comp in metrics["comparisons"]:
            if comp.get("kind") == "policy":  # the staleness table's, not an engine gap
                continue
            ref, cand = (side.removeprefix("scores/") for side in (comp["reference"], comp["candidate"]))
            label = cand if ref == "rollout" else f"{ref} vs {cand}"
            rows.setdefault(label, {})[kind] = {k: comp["metrics"].get(k) for k in SUMMARY_KEYS}
    return {"reference": "rollout = hf bf16 KV-cache decode", "comparisons": rows}


def _print_summary(summary: dict, out: Path, runs: list[str]) -> None:
    table = Table(title="demo: rollout (hf bf16 decode) vs each score set, MoE and its dense twin")
    for name in ("comparison", "moe k3_kl", "dense k3_kl", "moe F(1.5)", "moe router_diff_rate", "moe token_diff_rate"):
        table.add_column(name, justify="left" if name == "comparison" else "right")

    for label, sides in summary["comparisons"].items():
        moe, dense = sides.get("moe", {}), sides.get("dense", {})
        table.add_row(
            label,
            value(moe.get("k3_kl")),
            value(dense.get("k3_kl")),
            value(moe.get(EXTREME_FRACTION.at(1.5))),
            value(moe.get("router_diff_rate")),
            value(moe.get("token_diff_rate")),
        )
    console.print(table)
    for name in runs:
        console.print(f"{name} report: {(out / name / 'report' / 'index.html').resolve()}")
