"""The command line's side of engine options: `--engine-arg KEY=VALUE`, the old flags that now
stand for one engine arg each, and the `--help-engine` listing."""

from __future__ import annotations

import dataclasses

import typer

from mismatch_probe import help_flags
from mismatch_probe.engines import check_engine_args, engine_class
from mismatch_probe.engines.options import option_rows, parse_engine_args, valid_keys
from mismatch_probe.errors import ProbeError
from mismatch_probe.progress import console

# Flags from before `--engine-arg`, kept for one release: each is translated into its engine arg.
ALIASES = {
    "--server-url": "server_url",
    "--concurrency": "concurrency",
    "--timeout": "timeout_s",
    "--max-retries": "max_retries",
    "--tp": "tensor_parallel",
    "--ep": "expert_parallel",
    "--logprob-chunk": "logprob_chunk",
}
ENGINE_ARG_HELP = "An option of the chosen engine, KEY=VALUE (repeatable); --help-engine lists them."


def alias_help(flag: str) -> str:
    return f"Deprecated alias of --engine-arg {ALIASES[flag]}=VALUE."


def engine_args(kind: str, engine: str, items: list[str], aliases: dict[str, object]) -> dict[str, str]:
    """The engine args of one command: `--engine-arg`s plus the aliases given, checked by the engine."""
    args = parse_engine_args(items)
    fields = {f.name for f in dataclasses.fields(engine_class(kind, engine).Options)}
    for flag, value in aliases.items():
        if value is None:
            continue
        key = ALIASES[flag]
        if key in args:
            raise ProbeError(f"{flag}: also given as --engine-arg {key}={args[key]}; keep one")
        if key not in fields:
            raise ProbeError(
                f"{flag}: --engine {engine} has no option '{key}' ({valid_keys(engine_class(kind, engine).Options)})"
            )
        console.print(f"note: {flag} is deprecated; use --engine-arg {key}={value}", highlight=False)
        args[key] = str(value)
    check_engine_args(kind, engine, args)
    return args


def engine_help(kind: str, engine: str) -> str:
    """The `--help-engine` text: every option of the engine with its type, default and help, then its note."""
    cls = engine_class(kind, engine)
    rows = option_rows(cls.Options)
    title = f"Options of the {kind} engine '{engine}', given as --engine-arg KEY=VALUE:"
    if not rows:
        return f"{title}\n  (none)"
    header = ("KEY", "TYPE", "DEFAULT", "HELP")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = [title] + [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in [header, *rows]
    ]
    note = getattr(cls, "help_note", None)  # e.g. settings known to work on CPU
    return "\n".join(lines + ([note] if note else []))


def help_engine_flag(kind: str):
    """`--help-engine`: print the options of --engine (given before or after it) and exit.

    Both options are eager, so this runs before required options are checked; whichever of the
    two comes second on the command line prints."""

    def on_help(ctx: typer.Context, value: bool) -> bool:
        if value and not ctx.resilient_parsing:
            ctx.meta["help_engine"] = True
            if "engine" in ctx.params:
                _print_and_exit(kind, ctx.params["engine"])
        return value

    return help_flags.flag(
        False,
        "--help-engine",
        is_eager=True,
        callback=on_help,
        help="List the options of the chosen --engine (for --engine-arg) and exit.",
    )


def engine_option(kind: str, default: str, names: str):
    def on_engine(ctx: typer.Context, value: str) -> str:
        if ctx.meta.get("help_engine") and not ctx.resilient_parsing:
            _print_and_exit(kind, value)
        return value

    return typer.Option(
        default, "--engine", is_eager=True, callback=on_engine, help=f"{kind.capitalize()} engine: {names}."
    )


def _print_and_exit(kind: str, engine: str) -> None:
    try:
        typer.echo(engine_help(kind, engine))
    except ProbeError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(0)
