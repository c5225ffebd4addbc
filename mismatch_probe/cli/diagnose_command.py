"""`probe diagnose`: one command from a checkpoint and a rollout to the whole diagnosis (docs/diagnose.md)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from mismatch_probe.cli.pipeline_commands import MOE_FAMILY_HELP
from mismatch_probe.engines.cli_args import ENGINE_ARG_HELP, engine_option
from mismatch_probe.errors import ProbeError
from mismatch_probe.help_flags import flag
from mismatch_probe.progress import console


def diagnose(
    run: Path | None = typer.Argument(None, help="Run directory to diagnose (made by generate, import or a Recorder)."),
    out: Path | None = typer.Option(None, help="Second form: the run to sample first with --model and --prompts."),
    model: Path | None = typer.Option(
        None, help="Checkpoint folder the training passes score (default: the run's); with --prompts, also sampled."
    ),
    prompts: Path | None = typer.Option(None, help="Second form: JSONL prompts, sampled first as `probe generate`."),
    train_engine: str = typer.Option("hf", help="Training engine of every training pass: hf or megatron."),
    train_arg: list[str] | None = typer.Option(
        None, "--train-arg", help="KEY=VALUE: an --engine-arg of every training pass."
    ),
    dtype: str | None = typer.Option(
        None, help="The matched pass's dtype (default: the rollout's); second form: the rollout's too (default bf16)."
    ),
    budget: str | None = typer.Option(
        None, help="Wall time for the passes (90s, 20m, 1h): what does not fit is skipped."
    ),
    dry_run: bool = flag(False, help="Print and write the plan; run nothing."),
    as_json: bool = flag(False, "--json", help="Print the plan and the final screen as JSON."),
    batch_size: int = typer.Option(8, min=1, help="Sequences per forward (training) and per generate call."),
    engine: str = engine_option("inference", "hf", "second form: hf, sglang, vllm, sglang-offline, vllm-offline"),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help="Second form: " + ENGINE_ARG_HELP),
    samples_per_prompt: int = typer.Option(1, min=1, help="Second form, as `probe generate`."),
    num_prompts: int | None = typer.Option(None, min=1, help="Second form: use only the first N prompts."),
    temperature: float = typer.Option(1.0, min=0.0, help="Second form, as `probe generate`."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Second form, as `probe generate`."),
    top_k: int = typer.Option(0, min=0, help="Second form, as `probe generate`."),
    max_new_tokens: int = typer.Option(64, min=1, help="Second form, as `probe generate`."),
    logprobs_mode: str = typer.Option("raw", help="Second form, as `probe generate`: raw or processed."),
    seed: int = typer.Option(0, help="Second form, as `probe generate`."),
    trust_remote_code: bool = flag(False, help="Run the modeling code shipped with the checkpoint."),
    moe_family: str | None = typer.Option(None, help=MOE_FAMILY_HELP),
) -> None:
    """Plan and run every pass a run calls for (matched, fp32, repeats, R3, quant, sampling, doctor, sweep, locate,
    report) on one loaded checkpoint per configuration; writes RUN/diagnose/plan.json and ends with the diagnosis.
    Exit 0 finished, 1 a pass failed, 2 bad input."""
    from mismatch_probe.engines.base import EngineConfig, SamplingParams
    from mismatch_probe.engines.options import parse_engine_args
    from mismatch_probe.pipeline.diagnose.checks import parse_budget
    from mismatch_probe.pipeline.diagnose.job import DiagnoseJob
    from mismatch_probe.pipeline.diagnose.run import run_diagnose
    from mismatch_probe.pipeline.diagnose.summary import json_text, print_plan, print_screen
    from mismatch_probe.pipeline.generate import GenerateJob

    if (run is None) == (out is None):
        raise ProbeError("give RUN to diagnose, or --out RUN with --model and --prompts to sample it first")
    if (prompts is None) != (out is None):
        raise ProbeError("--out and --prompts go together: they sample the rollout first (the second form)")
    generate, command = None, ""
    if prompts is not None:
        if model is None:
            raise ProbeError("--prompts needs --model: the checkpoint to sample the rollout with")
        args = parse_engine_args(engine_arg or [])
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            seed=seed,
            logprobs_mode=logprobs_mode,
        )
        config = EngineConfig(dtype=dtype or "bf16", batch_size=batch_size, engine_args=args)
        generate = GenerateJob(
            model=model,
            prompts=prompts,
            out=out,
            engine=engine,
            params=params,
            config=config,
            samples_per_prompt=samples_per_prompt,
            num_prompts=num_prompts,
            trust_remote_code=trust_remote_code,
            moe_family=moe_family,
        )
        command = generate_command(generate)
    job = DiagnoseJob(
        run=out if run is None else run,
        model=model,
        train_engine=train_engine,
        train_args=parse_engine_args(train_arg or []),
        dtype=dtype,
        budget_s=parse_budget(budget),
        dry_run=dry_run,
        as_json=as_json,
        batch_size=batch_size,
        generate=generate,
        generate_command=command,
        trust_remote_code=trust_remote_code,
        moe_family=moe_family,
    )
    try:
        diagnosis = run_diagnose(job)
    except KeyboardInterrupt:  # diagnose has no --resume: the same command reuses what finished
        console.print("interrupted: finished passes and parts are kept; run the same command again to continue")
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json_text(diagnosis))
    else:
        print_plan(diagnosis)
        if not dry_run:
            print_screen(diagnosis)
    if diagnosis.exit_code:
        raise typer.Exit(diagnosis.exit_code)


def generate_command(job) -> str:
    """The `probe generate` that samples the same rollout, every sampling option spelled out."""
    q = lambda v: shlex.quote(str(v))  # noqa: E731
    p, c = job.params, job.config
    parts = [
        f"probe generate --model {q(job.model)} --prompts {q(job.prompts)} --out {q(job.out)} --engine {job.engine}",
        *(f"--engine-arg {q(f'{k}={v}')}" for k, v in c.engine_args.items()),
        f"--dtype {c.dtype} --batch-size {c.batch_size} --samples-per-prompt {job.samples_per_prompt}",
        *([f"--num-prompts {job.num_prompts}"] if job.num_prompts else []),
        f"--temperature {p.temperature:g} --top-p {p.top_p:g} --top-k {p.top_k} --max-new-tokens {p.max_new_tokens}",
        f"--logprobs-mode {p.logprobs_mode} --seed {p.seed}",
    ]
    return " ".join(parts)
