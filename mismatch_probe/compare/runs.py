"""`probe compare RUN_A RUN_B ...`: several runs' reports side by side (checkpoints over training, two
engine versions, two kernels), matched by (reference, candidate), from each run's report/metrics.json."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from mismatch_probe.compare.files import FIGURE
from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.progress import stdout_console
from mismatch_probe.report import numbers
from mismatch_probe.report.keys.catalogue import checked
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.metrics_file import read_metrics
from mismatch_probe.rundir.layout import MANIFEST, METRICS_FILE, Run
from mismatch_probe.rundir.ownership import Entry, Layout, json_with, named_files, refuse_foreign

DEFAULT_KEYS = checked("k3_kl", EXTREME_FRACTION.at(2), "router_diff_rate", "token_diff_rate", "is_ess")  # columns
COMPARE_JSON = "compare.json"
# What `probe compare` writes into --out, and so all that folder may hold before it replaces them.
COMPARE_LAYOUT = Layout(
    what="a probe compare folder",
    entries=(
        Entry(pattern=COMPARE_JSON, check=json_with("keys", "runs", "comparisons")),
        *named_files(f".{COMPARE_JSON}.tmp", "index.html", ".index.html.tmp", FIGURE),
    ),
    marker=COMPARE_JSON,
)


@dataclass
class RunMetrics:
    label: str
    root: Path
    metrics: dict  # the run's metrics.json

    def comparison(self, pair: tuple[str, str]) -> dict | None:
        return next((c for c in self.metrics["comparisons"] if (c["reference"], c["candidate"]) == pair), None)


@dataclass
class CompareResult:
    runs: list[RunMetrics]
    keys: list[str]
    pairs: list[tuple[str, str]]
    out: Path

    def cell(self, run: RunMetrics, pair: tuple[str, str], key: str) -> str:
        """`value [low, high]`; `—` where the run lacks the comparison or the key has no value."""
        comp = run.comparison(pair)
        if comp is None:
            return "—"
        return numbers.with_interval(comp["metrics"].get(key), comp["metrics"].get(ci_key(key)))

    def separation(self, run: RunMetrics, pair: tuple[str, str], key: str) -> str:
        """`above` or `below` where this run's 95% interval of `key` lies entirely above or below the first
        run's (the two differ beyond resampling noise); empty where they overlap or either lacks one."""
        first = self.runs[0]
        if run is first:
            return ""
        mine, theirs = run.comparison(pair), first.comparison(pair)
        if mine is None or theirs is None:
            return ""
        a, b = mine["metrics"].get(ci_key(key)), theirs["metrics"].get(ci_key(key))
        if not a or not b:
            return ""
        return "above" if a[0] > b[1] else ("below" if a[1] < b[0] else "")

    def marked(self, run: RunMetrics, pair: tuple[str, str], key: str) -> str:
        """The cell, with `▲ above first` / `▼ below first` where the intervals do not overlap."""
        side = self.separation(run, pair, key)
        mark = {"above": f" ▲ above {self.runs[0].label}", "below": f" ▼ below {self.runs[0].label}"}.get(side, "")
        return self.cell(run, pair, key) + mark

    def to_json(self) -> dict:
        comparisons = []
        for pair in self.pairs:
            values = {}
            for run in self.runs:
                comp = run.comparison(pair)
                values[run.label] = (
                    None
                    if comp is None
                    else {name: comp["metrics"].get(name) for key in self.keys for name in (key, ci_key(key))}
                )
            comparisons.append({"reference": pair[0], "candidate": pair[1], "runs": values})
        runs = [{"label": run.label, "path": str(run.root)} for run in self.runs]
        return {"schema_version": 1, "keys": list(self.keys), "runs": runs, "comparisons": comparisons}


def run_labels(roots: list[Path]) -> list[str]:
    """Directory names; runs whose names are equal get as many parent folders as it takes to tell them
    apart, and the same folder given twice gets `#1`, `#2`."""
    parts = [Path(root).resolve().parts for root in roots]
    labels = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i and p != mine]
        depth = 1
        while depth < len(mine) - 1 and any(p[-depth:] == mine[-depth:] for p in others):
            depth += 1
        labels.append("/".join(mine[-depth:]))
    repeats = Counter(labels)
    seen: Counter = Counter()
    for i, label in enumerate(labels):
        if repeats[label] > 1:
            seen[label] += 1
            labels[i] = f"{label} #{seen[label]}"
    return labels


def load_run(root: Path, label: str) -> RunMetrics:
    run = Run(root)
    if not run.root.is_dir():
        raise ProbeError(f"{root}: run directory not found")
    if not run.manifest_path.is_file():  # a folder that is no run needs no report, it needs another path
        raise ProbeError(f"{root}: not a probe run (no {MANIFEST})")
    if not run.metrics_path.is_file():
        raise ProbeError(f"{run.metrics_path}: file not found (run `probe report {shlex.quote(str(root))}` first)")
    return RunMetrics(label=label, root=run.root, metrics=read_metrics(run.metrics_path, run.root))


def check_keys(keys: list[str], runs: list[RunMetrics]) -> None:
    known = {key for run in runs for comp in run.metrics["comparisons"] for key in comp["metrics"]}
    for key in keys:
        if key not in known:
            listed = ", ".join(sorted(k for k in known if not k.endswith("_ci95")))
            raise ProbeError(f"--keys: unknown key '{key}' (in no run's {METRICS_FILE}; known keys: {listed})")


def compare_runs(roots: list[Path], keys: list[str] | None, out: Path) -> CompareResult:
    """Load every run's metrics.json, match comparisons, and write compare.json and index.html into `out`."""
    from mismatch_probe.compare.page import write_page

    if len(roots) < 2:
        raise ProbeError(f"probe compare: expected at least 2 runs, got {len(roots)}")
    runs = [load_run(Path(root), label) for root, label in zip(roots, run_labels(roots))]
    if keys is None:
        keys = list(DEFAULT_KEYS)
    else:
        keys = list(dict.fromkeys(k.strip() for k in keys if k.strip()))
        if not keys:
            raise ProbeError("--keys: expected at least one metric key, e.g. k3_kl,extreme_fraction@2")
        check_keys(keys, runs)
    pairs = list(dict.fromkeys((c["reference"], c["candidate"]) for run in runs for c in run.metrics["comparisons"]))
    result = CompareResult(runs=runs, keys=keys, pairs=pairs, out=Path(out))
    refuse_foreign(result.out, COMPARE_LAYOUT)
    try:
        result.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProbeError(f"{result.out}: cannot create the output folder ({exc.strerror or exc})") from exc
    write_json_atomic(result.out / COMPARE_JSON, result.to_json())
    write_page(result)
    return result


def print_compare(result: CompareResult) -> None:
    table = Table(title="runs compared: value [95% interval]; ▲/▼: interval entirely above/below the first run's")
    for name in ("comparison", "run", *result.keys):
        table.add_column(name, justify="left" if name in ("comparison", "run") else "right")
    for pair in result.pairs:
        for i, run in enumerate(result.runs):
            label = f"{pair[0]} vs {pair[1]}" if i == 0 else ""
            table.add_row(
                label,
                run.label,
                *(result.marked(run, pair, key) for key in result.keys),
                end_section=i == len(result.runs) - 1,
            )
    out = stdout_console()
    out.print(table)
    out.print(f"compare: {result.out / COMPARE_JSON}", highlight=False, markup=False, soft_wrap=True)
    out.print(f"page: {result.out / 'index.html'}", highlight=False, markup=False, soft_wrap=True)
