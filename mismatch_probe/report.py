"""`probe report`: metrics.json, plots and index.html for every compared pair of sides of a run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table

from .compare import aligned_chunks
from .errors import ProbeError
from .jsonfile import write_json_atomic
from .metrics import (
    DEFAULT_THRESHOLDS, ROUTING_KEYS, ProbabilityAccumulator, RoutingAccumulator, extreme_key, threshold_label,
)  # fmt: skip
from .progress import stdout_console
from .rundir import METRICS_FILE, SCORES, Run

ROUTING_SCOPES = ("all", "response")
DENSE_NOTE = "dense model: no routing"


@dataclass
class Comparison:
    reference: str
    candidate: str
    probability: ProbabilityAccumulator
    routing: RoutingAccumulator | None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.reference} vs {self.candidate}"

    def to_json(self, routing_scope: str) -> dict:
        metrics = self.probability.result()
        hists = None
        if self.routing is None:
            metrics |= {key: None for key in ROUTING_KEYS}
        else:
            metrics |= self.routing.result()
            hists = self.routing.histograms() if metrics["n_routing_tokens"] else None
        notes = list(self.notes)
        if self.routing is not None and not metrics["n_routing_tokens"]:
            notes.append("no position has routing on both sides: routing metrics are null")
        if metrics["n_tokens"] == 0:
            notes.append("no response token has a finite log-prob on both sides: probability metrics are null")
        for side, key in ((self.reference, "n_nonfinite_ref"), (self.candidate, "n_nonfinite_cand")):
            if metrics[key]:
                notes.append(f"{side}: {metrics[key]} response log-probs are NaN/inf, left out of the means ({key})")
        for side, key in ((self.reference, "n_null_ref"), (self.candidate, "n_null_cand")):
            if metrics[key]:
                notes.append(f"{side}: {metrics[key]} response log-probs are null, left out of the means ({key})")
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "metrics": metrics,
            "routing_scope": routing_scope,
            "notes": notes,
            "extreme_fraction_curve": self.probability.curve(),
            "routing_histograms": hists,
        }


@dataclass
class Report:
    directory: Path
    metrics: dict

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    @property
    def index_path(self) -> Path:
        return self.directory / "index.html"


def parse_thresholds(values) -> tuple[str, ...]:
    """Thresholds keep the spelling the user gave (their key is `extreme_fraction@<as given>`)."""
    labels = []
    for value in values:
        label = threshold_label(value)
        try:
            t = float(label)
        except ValueError:
            raise ProbeError(f"--thresholds: {label!r} is not a number") from None
        if not math.isfinite(t) or t < 1:
            raise ProbeError(f"--thresholds: {label} must be a finite number >= 1 (max(r, 1/r) is never below 1)")
        if label not in labels:
            labels.append(label)
    if not labels:
        raise ProbeError("--thresholds: expected at least one threshold, e.g. 1.5,2,5,10")
    return tuple(labels)


def compute_comparisons(run: Run, pairs, thresholds, routing_scope: str) -> list[Comparison]:
    """One streaming pass over every side involved; each side is read once whatever the number of pairs."""
    shape = run.manifest().routing
    comparisons = []
    for reference, candidate in pairs:
        routing = RoutingAccumulator(shape.num_layers, shape.top_k, shape.num_experts) if shape.is_moe else None
        notes = [] if shape.is_moe else [DENSE_NOTE]
        comparisons.append(Comparison(reference, candidate, ProbabilityAccumulator(thresholds), routing, notes))
    sides = list(dict.fromkeys(side for pair in pairs for side in pair))
    for chunks in aligned_chunks(run, sides, shape):
        for comp in comparisons:
            ref, cand = chunks[comp.reference], chunks[comp.candidate]
            comp.probability.update(
                ref.is_response, ref.logprob, ref.logprob_valid, cand.logprob, cand.logprob_valid, ref.top, cand.top
            )
            if comp.routing is not None:
                scope = ref.is_response if routing_scope == "response" else np.ones(len(ref.is_response), bool)
                comp.routing.update(
                    ref.sample_id, ref.experts, ref.experts_valid, cand.experts, cand.experts_valid, scope
                )
    return comparisons


def build_report(run_root, pairs=None, thresholds=DEFAULT_THRESHOLDS, routing_scope: str = "all") -> Report:
    from .html_report import write_index
    from .plots import write_plots

    run = Run(Path(run_root))
    manifest = run.manifest()
    if routing_scope not in ROUTING_SCOPES:
        raise ProbeError(f"--routing-scope: {routing_scope!r}, expected one of {', '.join(ROUTING_SCOPES)}")
    thresholds = parse_thresholds(thresholds)
    if pairs is None:
        pairs = run.default_pairs()
    else:
        pairs = [run.parse_pair(p) if isinstance(p, str) else (run.side_name(p[0]), run.side_name(p[1])) for p in pairs]
    if not pairs:
        raise ProbeError(f"{run.root / SCORES}: no score sets to compare the rollout with (run `probe rescore` first)")
    pairs = list(dict.fromkeys(pairs))
    run.check_sides(manifest, list(dict.fromkeys(side for pair in pairs for side in pair)))
    directory = run.report_dir
    if directory.exists() and not directory.is_dir():
        raise ProbeError(f"{directory}: exists and is not a directory; cannot write the report there")
    try:  # before the long read: an unwritable report folder should not cost a full pass
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".write-test").touch()
        (directory / ".write-test").unlink()
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report there ({exc.strerror or exc})") from exc
    comparisons = compute_comparisons(run, pairs, thresholds, routing_scope)
    metrics = {
        "schema_version": 1,
        "comparisons": [c.to_json(routing_scope) for c in comparisons],
    }
    try:
        plots = write_plots(directory, comparisons, metrics["comparisons"])
        write_json_atomic(run.metrics_path, metrics)
        write_index(directory, run, manifest, metrics, plots)
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report ({exc.strerror or exc})") from exc
    return Report(directory, metrics)


def print_summary(result: Report, run) -> None:
    """The terminal view of a report: headline metrics per comparison, notes and file paths."""
    comparisons = result.metrics["comparisons"]
    extreme = [extreme_key(2)] if any(extreme_key(2) in c["metrics"] for c in comparisons) else []
    columns = ["n_tokens", "k3_kl", *extreme, "argmax_flip_rate", "router_diff_rate", "token_diff_rate"]
    table = Table(title=f"mismatch: {run}")
    table.add_column("comparison")
    for name in columns:
        table.add_column(name, justify="right")
    for comp in comparisons:
        values = [comp["metrics"].get(name) for name in columns]
        table.add_row(f"{comp['reference']} vs {comp['candidate']}", *("—" if v is None else f"{v:.4g}" for v in values))
    out = stdout_console()
    out.print(table)
    for note in sorted({n for c in comparisons for n in c["notes"]}):
        out.print(f"note: {note}")
    out.print(f"metrics: {result.metrics_path}")
    out.print(f"report: {result.index_path}")
