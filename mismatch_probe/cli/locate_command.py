"""`probe locate`: the layer and the operation where two engine configurations first disagree."""

from __future__ import annotations

import typer

from mismatch_probe.cli.report_commands import RUN_HELP
from mismatch_probe.help_flags import flag
from mismatch_probe.rundir.location import run_path


def locate(
    run: str = typer.Argument(..., help=RUN_HELP),
    a: str | None = typer.Option(
        None,
        "--a",
        help="Reference configuration ENGINE:DTYPE[:KEY=VALUE,...], e.g. hf:bf16 or hf:fp32:model=ckpt/,attn_implementation=eager "
        "(keys: model and the hf or megatron training engine's --engine-arg keys, e.g. attn_implementation, lm_head_dtype, router_dtype, device; default: the rollout's engine, the hf engine at its dtype for sglang/vllm).",
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
