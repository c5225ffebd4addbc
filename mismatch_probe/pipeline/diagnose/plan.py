"""Which passes a run calls for, each as the stand-alone probe command that does it, and why a pass that does not
apply is skipped.

Every training pass scores with one engine at one dtype: the matched pass and those that differ from it only in
what a request or a switchable knob carries (repeats, R3, --sampling rollout, the sweep's knobs) share its loaded
checkpoint (`group`); fp32 and the rollout's quantization need checkpoints of their own.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mismatch_probe.pipeline.diagnose.job import DiagnoseJob, RolloutFacts
from mismatch_probe.pipeline.diagnose.passes import (
    DOCTOR,
    FP32,
    GENERATE,
    LOCATE,
    MATCHED,
    QUANT,
    R3_PASS,
    REPEATS,
    REPORT,
    SAMPLING,
    SCORING,
    SWEEP,
    Pass,
)
from mismatch_probe.pipeline.diagnose.prefill_pass import prefill_pass
from mismatch_probe.quant.served import matched_quant_args, plain_args
from mismatch_probe.rundir.layout import default_score_name, pass_names
from mismatch_probe.vocab import BF16, NO_REPLAY, R3
from mismatch_probe.vocab import FP32 as FP32_DTYPE

LOCATE_WORST, LOCATE_SAMPLES = 4, 2  # locate's sequences: the worst and a few drawn from the rest


def sweep_knobs(engine: str, is_moe: bool, dtype: str) -> list[str]:
    """The remedies What to do next proposes (report/verdict/actions.py) as training-side `--vary` values: an
    fp32 lm_head for the numerics, an fp32 router for the routing of an MoE model; knobs an engine switches on
    its loaded model, so the sweep shares the matched pass's checkpoint."""
    if engine == "hf":  # at fp32 both are fp32 already
        return [] if dtype == FP32_DTYPE else ["lm_head_dtype=fp32"] + (["router_dtype=fp32"] if is_moe else [])
    if is_moe:
        return ["override_transformer_config.moe_router_dtype=fp32"]
    return [] if dtype == "fp16" else ["dtype=fp16"]


def locate_reference(engine: str, dtype: str) -> str | None:
    """locate's --b: the training engine at fp32, against the rollout's own configuration (--a's default), names
    where the rollout's precision first stands out; at fp32 already, locate's default (the matched set)."""
    return None if dtype == FP32_DTYPE else f"{engine}:fp32"


def _args(args: dict) -> str:
    return "".join(f" --engine-arg {shlex.quote(f'{k}={v}')}" for k, v in args.items())


def _spelled(args: dict) -> str:
    return "".join(f" {k}={v}" for k, v in args.items())


def plain_training_args(job: DiagnoseJob, model) -> dict:
    """The --engine-arg values of every training pass but quant: --train-arg's, and where the model folder is an
    FP8 checkpoint (which loads quantized by its own scales) weight_quant=dequantized, so that only the quant
    pass quantizes."""
    if job.train_engine != "hf" or "weight_quant" in job.train_args:
        return dict(job.train_args)
    return {**job.train_args, **plain_args(model)}


def plan_passes(job: DiagnoseJob, facts: RolloutFacts) -> list[Pass]:
    root = shlex.quote(str(job.run))
    engine, dtype = job.train_engine, job.dtype or facts.dtype or BF16
    model = f" --model {shlex.quote(str(job.model))}" if job.model is not None else ""
    quant_args = matched_quant_args(facts.quantization, job.model or facts.model)
    train_args = plain_training_args(job, job.model or facts.model)
    trained = f"--engine {engine} --dtype {dtype}{_args(train_args)}{model}"
    rescore = f"probe rescore {root} {trained}"
    quant_rescore = f"probe rescore {root} --engine {engine} --dtype {dtype}{_args(job.train_args)}{model}"
    base = default_score_name(engine, dtype, NO_REPLAY)
    group = f"{engine} {dtype}{_spelled(train_args)}"
    passes = []
    if job.generate is not None:
        passes.append(Pass(name=GENERATE, command=job.generate_command))
    passes += [
        Pass(name=MATCHED, command=rescore, score_sets=[base], group=group),
        Pass(
            name=FP32,
            command=f"probe rescore {root} --engine {engine} --dtype fp32{_args(train_args)}{model}",
            score_sets=[default_score_name(engine, FP32_DTYPE, NO_REPLAY)],
            group=f"{engine} fp32{_spelled(train_args)}",
        ),
        Pass(
            name=REPEATS,
            command=f"{rescore} --repeats 2 --vary-batching",
            score_sets=pass_names(base, 2),
            group=group,
        ),
        Pass(
            name=R3_PASS,
            command=f"{rescore} --replay r3",
            score_sets=[default_score_name(engine, dtype, R3)],
            group=group,
        ),
        Pass(
            name=QUANT,
            command=f"{quant_rescore}{_args(quant_args or {})} --name {base}-quant",
            score_sets=[f"{base}-quant"],
            group=f"{engine} {dtype}{_spelled(job.train_args)}{_spelled(quant_args or {})}",
        ),
        Pass(
            name=SAMPLING,
            command=f"{rescore} --sampling rollout --name {base}-sampled",
            score_sets=[f"{base}-sampled"],
            group=group,
        ),
        prefill_pass(job.run, facts.engine, facts.server_url),
        Pass(name=DOCTOR, command=f"probe doctor {root}"),
    ]
    knobs = sweep_knobs(engine, facts.is_moe, dtype)
    vary = "".join(f" --vary {shlex.quote(k)}" for k in knobs)
    passes.append(
        Pass(
            name=SWEEP,
            command=f"probe sweep {root} --engine {engine} --dtype {dtype}{_args(train_args)}{vary}",
            score_sets=[f"{base}+{k.replace('=', '-')}" for k in knobs],
            group=group,
            knobs=knobs,
        )
    )
    b = locate_reference(engine, dtype)
    against = f" --b {b}" if b else ""
    passes.append(
        Pass(name=LOCATE, command=f"probe locate {root}{against} --worst {LOCATE_WORST} --samples {LOCATE_SAMPLES}")
    )
    passes.append(Pass(name=REPORT, command=f"probe report {root}"))
    _skip_what_does_not_apply(passes, job, facts, dtype, quant_args, knobs)
    return passes


def _skip_what_does_not_apply(passes, job, facts, dtype, quant_args, knobs) -> None:
    by_name = {p.name: p for p in passes}
    if dtype == FP32_DTYPE:
        by_name[FP32].skip("the matched pass is at fp32 already: it is the fp32 pass")
    if not facts.is_moe:
        by_name[R3_PASS].skip("dense model: no routing to replay")
    if facts.quantization is None:
        by_name[QUANT].skip("the rollout is not quantized")
    elif job.train_engine != "hf":
        by_name[QUANT].skip(f"the {job.train_engine} engine has no fake quantization: --train-engine hf measures it")
    elif quant_args is None:
        by_name[QUANT].skip(f"no training pass is known to match the rollout's quantization {facts.quantization}")
    if not facts.truncates:
        by_name[SAMPLING].skip("the rollout's log-probs are raw, over the full vocabulary: nothing truncated")
    if not knobs:
        by_name[SWEEP].skip(f"no remedy knob of the {job.train_engine} engine applies at {dtype}")
    own_model = job.model is None or _same_path(job.model, facts.model)
    if facts.model is None and job.model is None:
        why = "the run names no model (imported or recorded): give --model CKPT"
        for name in (*SCORING, SWEEP, LOCATE):
            if by_name[name].status != "skipped":
                by_name[name].skip(why)
    elif not own_model:
        for name in (SWEEP, LOCATE):
            if by_name[name].status != "skipped":
                by_name[name].skip(f"`probe {name}` scores the model the run's manifest names, not --model")


def _same_path(a, b) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()
