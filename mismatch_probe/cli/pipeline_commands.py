"""`probe generate`, `rescore`, `demo` and `import`: the commands that make a run."""

from __future__ import annotations

from pathlib import Path

import typer

from mismatch_probe.engines.cli_args import ENGINE_ARG_HELP, alias_help, engine_option, help_engine_flag
from mismatch_probe.help_flags import flag
from mismatch_probe.importers import DumpFormat
from mismatch_probe.progress import console

MOE_FAMILY_HELP = (
    "MoE family of a checkpoint whose model_type and modules name none, as one of the family's "
    "model_types (e.g. qwen3_moe, deepseek_v3); overrides what probe recognises. An unknown name lists "
    "the known ones."
)


def generate(
    model: Path = typer.Option(..., help="HF checkpoint folder (config.json, weights, tokenizer)."),
    prompts: Path = typer.Option(
        ..., help="JSONL: {'prompt': ...}, {'messages': [...]} or {'input_ids': [...]} per line."
    ),
    out: Path = typer.Option(..., help="Run directory to create."),
    engine: str = engine_option("inference", "hf", "hf, sglang, vllm, sglang-offline, vllm-offline"),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help=ENGINE_ARG_HELP),
    help_engine: bool = help_engine_flag("inference"),
    samples_per_prompt: int = typer.Option(1, min=1),
    num_prompts: int | None = typer.Option(None, min=1, help="Use only the first N prompts."),
    temperature: float = typer.Option(1.0, min=0.0, help="0 means greedy (scored at T=1)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    top_k: int = typer.Option(0, min=0, help="0 disables top-k."),
    max_new_tokens: int = typer.Option(64, min=1),
    logprobs_mode: str = typer.Option(
        "raw",
        help="raw: log_softmax(logits / T) over the full vocabulary; processed: renormalised over the top-p/top-k "
        "support sampled from (vLLM's processed_logprobs under top-p), with its log mass in kept_logmass (hf engine).",
    ),
    seed: int = typer.Option(0),
    batch_size: int = typer.Option(16, min=1, help="Samples per generate call (hf) and per part file."),
    dtype: str = typer.Option(
        "bf16", help="hf engine: bf16, fp16, fp32 or fp32-bf16w (a server engine records the server's)."
    ),
    server_url: str | None = typer.Option(None, help=alias_help("--server-url")),
    concurrency: int | None = typer.Option(None, min=1, help=alias_help("--concurrency")),
    timeout: float | None = typer.Option(None, help=alias_help("--timeout")),
    max_retries: int | None = typer.Option(None, min=0, help=alias_help("--max-retries")),
    resume: bool = flag(False, help="Continue an interrupted run, keeping finished samples."),
    overwrite: bool = flag(False, help="Replace an existing run."),
    trust_remote_code: bool = flag(
        False, help="Run the modeling code shipped with the checkpoint (model types transformers lacks)."
    ),
    moe_family: str | None = typer.Option(None, help=MOE_FAMILY_HELP),
) -> None:
    """Sample responses and dump per-token log-probs and routed experts to RUN/rollout/."""
    from mismatch_probe.engines.base import EngineConfig, SamplingParams
    from mismatch_probe.engines.cli_args import engine_args
    from mismatch_probe.pipeline.generate import GenerateJob, run_generate

    aliases = {
        "--server-url": server_url,
        "--concurrency": concurrency,
        "--timeout": timeout,
        "--max-retries": max_retries,
    }
    args = engine_args("inference", engine, engine_arg or [], aliases)
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
        logprobs_mode=logprobs_mode,
    )
    config = EngineConfig(dtype=dtype, batch_size=batch_size, engine_args=args)
    run_generate(
        GenerateJob(
            model=model,
            prompts=prompts,
            out=out,
            engine=engine,
            params=params,
            config=config,
            samples_per_prompt=samples_per_prompt,
            num_prompts=num_prompts,
            resume=resume,
            overwrite=overwrite,
            trust_remote_code=trust_remote_code,
            moe_family=moe_family,
        )
    )


def rescore(
    run: Path = typer.Argument(..., help="Run directory made by `probe generate`."),
    engine: str = engine_option(
        "training",
        "hf",
        "hf, megatron; sglang, vllm, sglang-offline, vllm-offline: the inference engine's own prefill of the rollout "
        "(decode against prefill)",
    ),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help=ENGINE_ARG_HELP),
    help_engine: bool = help_engine_flag("training"),
    model: Path | None = typer.Option(None, help="Checkpoint folder; default: the rollout manifest's model."),
    dtype: str | None = typer.Option(
        None,
        help="bf16, fp16, fp32 or fp32-bf16w (fp32 compute on bf16-rounded weights); default fp32, and the "
        "rollout's own dtype for --engine sglang, vllm, sglang-offline or vllm-offline.",
    ),
    replay: str = typer.Option(
        "none",
        help="none; r3: replay the rollout's routed experts; r2 (with --old): replay the --old score set's experts.",
    ),
    old: str | None = typer.Option(
        None,
        help="Score a new policy's checkpoint (--model) against this score set of the rollout's own checkpoint "
        "(same engine and dtype; replay none, or r3 for --replay r3). See docs/staleness.md.",
    ),
    policy_step: int | None = typer.Option(
        None, min=0, help="With --old: the policy step of the --model checkpoint (RL steps since the rollout's)."
    ),
    router_logprobs: bool = flag(
        False,
        help="Write each row's router log-probabilities at its experts and, with --old, at the old set's experts "
        "(softmax routers, hf engine): the router shift the report measures.",
    ),
    sampling: str = typer.Option(
        "raw",
        help="raw: log_softmax(logits / T) over the full vocabulary; rollout: the rollout's temperature, top-p and "
        "top-k on the training logits, renormalised over this side's own support (kept_logmass written; a sampled "
        "token outside it is stored as null and counted in n_outside_support).",
    ),
    repeats: int = typer.Option(1, min=1, help="Passes, written as NAME-pass1..N."),
    vary_batching: bool = flag(
        False, help="Passes after the first shuffle order, change micro-batch size and padding."
    ),
    name: str | None = typer.Option(
        None, help="Score-set name; default ENGINE-DTYPE[-r2|-r3], with -stepN for a new policy's pass."
    ),
    role: str | None = typer.Option(
        None,
        help="The score set's role: matched (the training side as the team runs it; the verdict speaks of it) or a "
        "diagnostic role (fp32, r3, repeats, quant, sampling, sweep, ...); default: the diagnostic role the options "
        "imply, else none recorded.",
    ),
    batch_size: int = typer.Option(8, min=1, help="Sequences per forward (micro-batch)."),
    logprob_chunk: int | None = typer.Option(None, min=1, help=alias_help("--logprob-chunk")),
    tensor_parallel: int | None = typer.Option(None, "--tp", min=1, help=alias_help("--tp")),
    expert_parallel: int | None = typer.Option(None, "--ep", min=1, help=alias_help("--ep")),
    resume: bool = flag(False, help="Continue an interrupted rescore, keeping finished parts."),
    overwrite: bool = flag(False, help="Replace existing score sets of the same name."),
    trust_remote_code: bool = flag(
        False, help="Run the modeling code shipped with the checkpoint (model types transformers lacks)."
    ),
    moe_family: str | None = typer.Option(None, help=MOE_FAMILY_HELP),
) -> None:
    """Score the rollout's stored token ids with a training engine into RUN/scores/NAME/."""
    from mismatch_probe.engines.base import EngineConfig
    from mismatch_probe.engines.cli_args import engine_args
    from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
    from mismatch_probe.rundir.roles import check_role

    aliases = {"--logprob-chunk": logprob_chunk, "--tp": tensor_parallel, "--ep": expert_parallel}
    args = engine_args("training", engine, engine_arg or [], aliases)
    config = EngineConfig(dtype=dtype or "", batch_size=batch_size, engine_args=args)  # "": the default (rescore.py)
    run_rescore(
        RescoreJob(
            run=run,
            engine=engine,
            config=config,
            model=model,
            replay=replay,
            repeats=repeats,
            vary_batching=vary_batching,
            name=name,
            resume=resume,
            overwrite=overwrite,
            trust_remote_code=trust_remote_code,
            moe_family=moe_family,
            old=old,
            policy_step=policy_step,
            router_logprobs=router_logprobs,
            sampling=sampling,
            role=check_role(role),
        )
    )


def demo(
    out: Path = typer.Option(
        Path("demo-run"),
        help="Where to write the demo runs (a previous demo there is replaced; anything else there is refused).",
    ),
    num_prompts: int = typer.Option(
        256,
        min=1,
        help="Prompts from the demo set (256 in all), each sampled 8 times; the production rollouts take the first "
        "64 of them, twice each, and the sweep's run all of them, 4 times each.",
    ),
    max_new_tokens: int = typer.Option(64, min=1),
) -> None:
    """Run generate, rescore (hf and megatron; fp32, bf16, R3, repeated passes) and report on the shipped demo models,
    then an fp8 and a top-p rollout of the MoE model with their matched passes, and a sweep of its remedies."""
    from mismatch_probe.pipeline.demo.run import DATA, run_demo

    run_demo(
        out=out,
        models=DATA / "models",
        prompts=DATA / "prompts" / "demo.jsonl",
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
    )


def import_dump(
    format: DumpFormat = typer.Argument(..., help="The dump's framework (docs/import.md says which files each reads)."),
    path: Path = typer.Argument(..., help="The dump: a file, or a folder of them."),
    out: Path = typer.Option(..., "--out", help="Run directory to create (absent or empty)."),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="The model folder the dump was sampled from (dumps name none): token text in the report, and rescoring.",
    ),
    temperature: float | None = typer.Option(
        None, "--temperature", help="The temperature both sides' log-probs were computed at (dumps hold none)."
    ),
    overwrite: bool = flag(False, "--overwrite", help="Replace OUT if it is a probe run (nothing else is deleted)."),
    trust_pickle: bool = flag(
        False,
        "--trust-pickle",
        help="Unpickle a verl, slime or miles dump in full, custom classes included: pickles run code, so only for "
        "dumps you trust (without it, only what the frameworks' writers emit is loaded).",
    ),
) -> None:
    """Turn a training framework's dump of both log-probs into a probe run (rollout + scores/training), streamed."""
    from mismatch_probe.importers.job import ImportJob, run_import

    job = ImportJob(
        format=format,
        path=path,
        out=out,
        model=model,
        temperature=temperature,
        overwrite=overwrite,
        trust_pickle=trust_pickle,
    )
    result = run_import(job)
    console.print(f"imported {result.samples} samples ({result.tokens} tokens) into {out}", highlight=False)
    for line in result.lacks:
        console.print(f"  lacks {line}", highlight=False, markup=False)
