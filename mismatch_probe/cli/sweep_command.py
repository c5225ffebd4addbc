"""`probe sweep`: score a run under a base training configuration and variants of it (docs/remedies.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from mismatch_probe.cli.pipeline_commands import MOE_FAMILY_HELP
from mismatch_probe.engines.cli_args import ENGINE_ARG_HELP, engine_option, help_engine_flag
from mismatch_probe.help_flags import flag
from mismatch_probe.progress import console

VARY_HELP = (
    "[rollout:|both:]KNOB=V1[,V2...] (repeatable): one variant per value. KNOB is dtype or an --engine-arg key of "
    "the engine; a training variant is the score set BASE+KNOB-VALUE of RUN; rollout: samples RUN's prompts again "
    "with the knob on the rollout's hf engine into the sibling run RUN+rollout.KNOB-VALUE, scored with the base; "
    "both: applies it on both sides."
)


def sweep(
    run: Path = typer.Argument(..., help="Run directory made by `probe generate`."),
    engine: str = engine_option("training", "hf", "hf, megatron"),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help=ENGINE_ARG_HELP + " The base's."),
    help_engine: bool = help_engine_flag("training"),
    dtype: str = typer.Option("bf16", help="The base's dtype: bf16, fp16, fp32 or fp32-bf16w."),
    vary: list[str] | None = typer.Option(None, "--vary", help=VARY_HELP),
    batch_size: int = typer.Option(8, min=1, help="Sequences per forward (micro-batch)."),
    overwrite: bool = flag(
        False, help="Replace score sets and sibling runs that exist but were made otherwise than this sweep makes them."
    ),
    trust_remote_code: bool = flag(
        False, help="Run the modeling code shipped with the checkpoint (model types transformers lacks)."
    ),
    moe_family: str | None = typer.Option(None, help=MOE_FAMILY_HELP),
) -> None:
    """Score RUN's tokens under a base configuration and one variant per --vary value (reusing finished score sets,
    resuming interrupted ones, loading the checkpoint once per engine and dtype); writes RUN/sweep.json."""
    from mismatch_probe.engines.base import EngineConfig
    from mismatch_probe.engines.cli_args import engine_args
    from mismatch_probe.pipeline.sweep.plan import SweepJob
    from mismatch_probe.pipeline.sweep.run import run_sweep

    args = engine_args("training", engine, engine_arg or [], {})
    config = EngineConfig(dtype=dtype, batch_size=batch_size, engine_args=args)
    job = SweepJob(
        run=run,
        engine=engine,
        config=config,
        vary=tuple(vary or ()),
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
        moe_family=moe_family,
    )
    try:
        run_sweep(job)
    except KeyboardInterrupt:  # the sweep has no --resume: the same command resumes it
        console.print("interrupted: finished score sets and parts are kept; run the same command again to continue")
        raise typer.Exit(130) from None
