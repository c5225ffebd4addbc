"""`probe report`, `gate`, `doctor` and `compare`: the commands that read runs."""

from __future__ import annotations

from pathlib import Path

import typer

from mismatch_probe.help_flags import flag
from mismatch_probe.rundir.location import run_path

RUN_HELP = "Run directory, or its URL (s3://BUCKET/RUN and any URL fsspec opens; needs the \\[remote] extra)."


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
    from mismatch_probe.report.build import build_report
    from mismatch_probe.report.render.terminal.summary import print_summary
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
    from mismatch_probe.gate.check import checks_json, evaluate, junit_target, parse_limits, write_junit

    if junit is not None:
        junit_target(junit)  # refuse the user's own file before any work
    run = run_path(run)
    from mismatch_probe.gate.drift import parse_max_drift

    max_drift = parse_max_drift(max_drift)
    limits = parse_limits(max_ or [], config, required=baseline is None and max_drift is None and not history)
    from mismatch_probe.gate.findings import gate_findings, refused
    from mismatch_probe.gate.show import print_checks, print_findings
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
