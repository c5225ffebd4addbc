"""The `probe` command line: a thin shell over the pipeline modules."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import rich.markup
import typer

from mismatch_probe import __version__
from mismatch_probe.engines.cli_args import ENGINE_ARG_HELP, alias_help, engine_option, help_engine_flag
from mismatch_probe.errors import ProbeError
from mismatch_probe.help_flags import flag
from mismatch_probe.importers import DumpFormat
from mismatch_probe.progress import console
from mismatch_probe.rundir.location import run_path

HELP = "Measure the training-inference mismatch of an LLM checkpoint: log-probs and MoE routing."
app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, pretty_exceptions_enable=False)
DEBUG_ENV = "PROBE_DEBUG"
MOE_FAMILY_HELP = (
    "MoE family of a checkpoint whose model_type and modules name none, as one of the family's "
    "model_types (e.g. qwen3_moe, deepseek_v3); overrides what probe recognises. An unknown name lists "
    "the known ones."
)


def print_version(requested: bool) -> None:
    if requested:
        typer.echo(f"mismatch-probe {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = flag(False, "--debug", help="Show tracebacks for errors."),
    version: bool = flag(False, "--version", callback=print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Measure the training-inference mismatch of an LLM checkpoint (log-probs and MoE routing)."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


def handles_errors(fn):
    """One error path: a one-line message and exit 2 (bad input) or 1 (failure); --debug re-raises."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ProbeError as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            # Escape: messages quote user text and Python reprs whose [brackets] rich would eat as markup.
            console.print(f"[bold red]error:[/] {rich.markup.escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted: finished parts are kept; re-run with --resume to continue")
            raise typer.Exit(130) from None

    return wrapper


def command(*args, **kwargs):
    def register(fn):
        return app.command(*args, **kwargs)(handles_errors(fn))

    return register


# ---- generate and rescore -------------------------------------------------------------------


@command("generate")
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
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed)
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


@command("rescore")
def rescore(
    run: Path = typer.Argument(..., help="Run directory made by `probe generate`."),
    engine: str = engine_option("training", "hf", "hf, megatron"),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help=ENGINE_ARG_HELP),
    help_engine: bool = help_engine_flag("training"),
    model: Path | None = typer.Option(None, help="Checkpoint folder; default: the rollout manifest's model."),
    dtype: str = typer.Option("fp32", help="bf16, fp16, fp32 or fp32-bf16w (fp32 compute on bf16-rounded weights)."),
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
    repeats: int = typer.Option(1, min=1, help="Passes, written as NAME-pass1..N."),
    vary_batching: bool = flag(
        False, help="Passes after the first shuffle order, change micro-batch size and padding."
    ),
    name: str | None = typer.Option(
        None, help="Score-set name; default ENGINE-DTYPE[-r2|-r3], with -stepN for a new policy's pass."
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

    aliases = {"--logprob-chunk": logprob_chunk, "--tp": tensor_parallel, "--ep": expert_parallel}
    args = engine_args("training", engine, engine_arg or [], aliases)
    config = EngineConfig(dtype=dtype, batch_size=batch_size, engine_args=args)
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
        )
    )


@command("demo")
def demo(
    out: Path = typer.Option(
        Path("demo-run"),
        help="Where to write the demo runs (a previous demo there is replaced; anything else there is refused).",
    ),
    num_prompts: int = typer.Option(256, min=1, help="Prompts from the demo set (256 in all), each sampled 8 times."),
    max_new_tokens: int = typer.Option(64, min=1),
) -> None:
    """Run generate, rescore (hf and megatron; fp32, bf16, R3, repeated passes) and report on the shipped demo models."""
    from mismatch_probe.pipeline.demo.run import DATA, run_demo

    run_demo(
        out=out,
        models=DATA / "models",
        prompts=DATA / "prompts" / "demo.jsonl",
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
    )


# ---- import ----------------------------------------------------------------------------------


@command("import")
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
) -> None:
    """Turn a training framework's dump of both log-probs into a probe run (rollout + scores/training), streamed."""
    from mismatch_probe.importers.job import ImportJob, run_import

    job = ImportJob(format=format, path=path, out=out, model=model, temperature=temperature, overwrite=overwrite)
    result = run_import(job)
    console.print(f"imported {result.samples} samples ({result.tokens} tokens) into {out}", highlight=False)
    for line in result.lacks:
        console.print(f"  lacks {line}", highlight=False, markup=False)


# ---- report and gate -------------------------------------------------------------------------


RUN_HELP = "Run directory, or its URL (s3://BUCKET/RUN and any URL fsspec opens; needs the \\[remote] extra)."


@command("report")
def report(
    run: str = typer.Argument(..., help=RUN_HELP),
    pair: list[str] | None = typer.Option(
        None,
        "--pair",
        help="REFERENCE:CANDIDATE, e.g. rollout:scores/hf-bf16, replaces the pairs; +REFERENCE:CANDIDATE adds one (repeatable; default: the pairs of the run's last report, else rollout vs every score set and consecutive repeated passes).",
    ),
    thresholds: str | None = typer.Option(
        None,
        "--thresholds",
        help="Comma-separated t for extreme_fraction@t (default: the last report's, else 1.5,2,5,10).",
    ),
    routing_scope: str | None = typer.Option(
        None, "--routing-scope", help="all (prompt + response) or response (default: the last report's, else all)."
    ),
    tis_caps: str | None = typer.Option(
        None,
        "--tis-caps",
        help="Comma-separated C for tis_clip_fraction@C (tokens with r > C; default: the last report's, else 2,5).",
    ),
    geo_bounds: str | None = typer.Option(
        None,
        "--geo-bounds",
        help="Comma-separated T for seq_geo_reject_fraction@T (default: the last report's, else 1.001,1.01).",
    ),
    worst: int | None = typer.Option(
        None,
        "--worst",
        help="List the N tokens of largest |delta| per comparison (metrics.json keeps 20 by default) and print them.",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        help="Processes reading the run, each its own ranges of row groups (default: half the cores available, as each process keeps about two busy). With --ray local: the CPUs of the local Ray instance.",
    ),
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="Run the pass as Ray tasks: local (start Ray here), auto (the cluster of the environment) or ray://HOST:PORT. Every node must see the run at the same path. Needs the [ray] extra.",
    ),
    drift_ratio: float | None = typer.Option(
        None,
        "--drift-ratio",
        help="On a run that records steps: the factor k3 must change by (the ratio's interval wholly above it, or below 1/it) for its change-point to be named a drift (default: the last report's, else 1.5).",
    ),
    ppo_bounds: str | None = typer.Option(
        None,
        "--ppo-bounds",
        help="Policy comparisons: comma-separated below@B / above@B for ppo_ratio_*_fraction@B and rspo_ratio_*_fraction@B (default: the last report's, else below@0.8,above@1.2,above@1.27).",
    ),
    bands: Path | None = typer.Option(
        None,
        "--bands",
        help="TOML file whose \\[bands] table replaces the published k3 bands the verdict words use, e.g. the gate's --config file: acceptable = 1e-3, dense = [1e-5, 1e-3], moe = [1e-3, 1e-1].",
    ),
) -> None:
    """Compute the mismatch metrics (with 95% bootstrap intervals over sequences), plots and HTML report of a run.
    Options not given repeat the run's last report (remembered in its metrics.json)."""
    from mismatch_probe.report.build import build_report, print_summary
    from mismatch_probe.report.render.terminal.worst import print_worst

    split = lambda text: None if text is None else text.split(",")  # noqa: E731
    run = run_path(run)
    result = build_report(
        run,
        pairs=pair or None,
        thresholds=split(thresholds),
        routing_scope=routing_scope,
        tis_caps=split(tis_caps),
        geo_bounds=split(geo_bounds),
        worst=worst,
        workers=workers,
        ray=ray,
        bands_file=bands,
        drift_ratio=drift_ratio,
        ppo_bounds=split(ppo_bounds),
    )
    print_summary(result, run)
    if worst:
        print_worst(result.metrics)


@command("gate")
def gate(
    run: str = typer.Argument(..., help=RUN_HELP),
    max_: list[str] | None = typer.Option(None, "--max", help="KEY=VALUE upper limit, e.g. k3_kl=1e-3 (repeatable)."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help='TOML limits file: \\[max] k3_kl = 1e-3, "extreme_fraction@2" = 1e-3; an optional \\[bands] table is for probe report --bands.',
    ),
    pair: list[str] | None = typer.Option(
        None, "--pair", help="Only these comparisons, REFERENCE:CANDIDATE (repeatable)."
    ),
    as_json: bool = flag(False, "--json", help="Print the checks as JSON instead of a table."),
    junit: Path | None = typer.Option(
        None,
        "--junit",
        help="Also write the checks as JUnit XML here (a new file, or one probe gate wrote: never your own).",
    ),
    use_ci_upper: bool = flag(
        False,
        "--use-ci-upper",
        help="Check the upper end of each metric's 95% interval against its limit instead of the point value (keys without an interval: the value).",
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="Another run of the same setup (a folder, or a URL as RUN): fail when a metric's 95% interval lies entirely above the baseline's (candidate's lower end > baseline's upper end). Checks the --max keys, or every higher-is-worse key.",
    ),
    max_drift: float | None = typer.Option(
        None,
        "--max-drift",
        help="On a run that records steps: fail when k3 rose over the steps (the report's drift) by a ratio whose 95% interval's lower end exceeds R, e.g. 2. A limit by itself; a drop never fails.",
    ),
    history: list[str] | None = typer.Option(
        None,
        "--history",
        help="An earlier run of the same setup (repeatable; at least 3): fail when a key's 95% interval lies wholly above every history run's. Checks the --max keys, else k3_kl and extreme_fraction@2. With fewer than 3 runs: says so and passes (fails under --strict).",
    ),
    strict: bool = flag(
        False,
        "--strict",
        help="Exit 2 when the baseline or a history run is another kind of run (model, config hash, MoE or dense, routing shape, scoring temperature) instead of warning; exit 1 when --history has fewer than 3 runs.",
    ),
    allow: list[str] | None = typer.Option(
        None, "--allow", help="Pass despite this `probe doctor` finding, e.g. greedy (repeatable)."
    ),
) -> None:
    """Fail (exit 1) when a metric exceeds its limit or regresses beyond noise against a baseline; exit 2 on unusable input."""
    from mismatch_probe.gate.check import checks_json, evaluate, junit_target, parse_limits, print_checks, write_junit

    if junit is not None:
        junit_target(junit)  # refuse the user's own file before any work
    run = run_path(run)
    from mismatch_probe.gate.drift import parse_max_drift

    max_drift = parse_max_drift(max_drift)
    limits = parse_limits(max_ or [], config, required=baseline is None and max_drift is None and not history)
    from mismatch_probe.gate.findings import gate_findings, print_findings, refused
    from mismatch_probe.rundir.layout import Run

    baseline = None if baseline is None else run_path(baseline)
    checks = evaluate(
        run,
        limits,
        pair or [],
        use_ci_upper=use_ci_upper,
        baseline=baseline,
        strict=strict,
        max_drift=max_drift,
        history=[run_path(h) for h in history or []],
    )
    findings = gate_findings(Run(run), allow or [])
    if junit is not None:
        write_junit(junit, checks, findings)
    if as_json:
        typer.echo(checks_json(checks, findings))
    else:
        print_checks(checks, run)
        print_findings(findings)
    if any(c.status == "fail" for c in checks) or refused(findings):
        raise typer.Exit(1)


@command("doctor")
def doctor(
    run: str = typer.Argument(..., help=RUN_HELP),
    as_json: bool = flag(False, "--json", help="Print the findings as JSON."),
) -> None:
    """Check a run's data for setup bugs that pass for mismatch; exit 0 healthy, 1 findings, 2 bad input."""
    from mismatch_probe.doctor.run import run_checks
    from mismatch_probe.doctor.show import findings_json, print_findings

    run = run_path(run)
    findings = run_checks(run)
    if as_json:
        typer.echo(findings_json(findings))
    else:
        print_findings(findings, run)
    if findings:
        raise typer.Exit(1)


@command("locate")
def locate(
    run: str = typer.Argument(..., help=RUN_HELP),
    a: str | None = typer.Option(
        None,
        "--a",
        help="Reference configuration ENGINE:DTYPE[:KEY=VALUE,...], e.g. hf:bf16 or hf:fp32:model=ckpt/,attn_implementation=eager "
        "(keys: model, attn_implementation, device; default: the rollout's engine, the hf engine at its dtype for sglang/vllm).",
    ),
    b: str | None = typer.Option(
        None, "--b", help="Configuration compared with --a, same form (default: the training set's of largest k3)."
    ),
    worst: int = typer.Option(
        4, "--worst", min=0, help="The N sequences of largest k3 against the training set of largest k3."
    ),
    samples: int = typer.Option(4, "--samples", min=0, help="N more sequences drawn from the rest with a fixed seed."),
    batch_size: int = typer.Option(
        4, "--batch-size", min=1, help="Sequences per forward (the captures of one batch are held)."
    ),
    as_json: bool = flag(False, "--json", help="Print the result as JSON: located {layer, op} or null, and rows."),
) -> None:
    """Find the layer and operation where two engine configurations first disagree (hooks on the hf engine);
    writes RUN/locate/index.html. Exit 0 compared, 1 the two agree bitwise, 2 bad input."""
    from mismatch_probe.locate.job import LocateJob, run_locate
    from mismatch_probe.locate.show import json_text, print_result

    job = LocateJob(run=run_path(run), a=a, b=b, worst=worst, samples=samples, batch_size=batch_size, quiet=as_json)
    result = run_locate(job)
    if as_json:
        typer.echo(json_text(result))
    else:
        print_result(result)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@command("compare")
def compare(
    runs: list[Path] | None = typer.Argument(None, help="Two or more run directories, each with report/metrics.json."),
    keys: str | None = typer.Option(
        None,
        "--keys",
        help="Comma-separated metric keys (default: k3_kl,extreme_fraction@2,router_diff_rate,token_diff_rate,is_ess).",
    ),
    out: Path = typer.Option(Path("probe-compare"), "--out", help="Folder for index.html and compare.json."),
) -> None:
    """Put several runs' reports side by side: a table of chosen keys with intervals, F(t) overlays, one HTML page."""
    from mismatch_probe.compare.runs import compare_runs, print_compare

    print_compare(compare_runs(runs or [], keys.split(",") if keys is not None else None, out))


@command("env")
def env(as_json: bool = flag(False, "--json", help="Print the environment as JSON.")) -> None:
    """Versions of probe, Python, torch (CUDA, GPUs) and the engines' packages, and which engines can run here."""
    from mismatch_probe.environment import collect, print_environment

    found = collect()
    if as_json:
        typer.echo(json.dumps(found.to_json(), indent=2))
    else:
        print_environment(found)


@command("keys")
def keys(
    format: str = typer.Option("table", "--format", help="table, markdown (the README's key table) or json."),  # noqa: A002
) -> None:
    """Every metric key: its formula and the name verl, slime/miles, NeMo-RL and prime-rl log it under, or none."""
    from mismatch_probe.report.keys.rosetta import print_keys

    print_keys(format)


if __name__ == "__main__":
    sys.exit(app())
