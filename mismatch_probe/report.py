"""`probe report`: metrics.json, plots and index.html for every compared pair of sides of a run."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table

from .attribution import attribute, numerics_plan
from .bootstrap import format_with_interval, with_intervals
from .breakdowns import Breakdowns, ResponseIndex, compared_deltas
from .compare import aligned_chunks
from .corrections import DEFAULT_GEO_BOUNDS, DEFAULT_TIS_CAPS, SequenceStats
from .errors import ProbeError
from .jsonfile import write_json_atomic
from .metrics import DEFAULT_THRESHOLDS, ROUTING_KEYS, ProbabilityAccumulator, extreme_key  # noqa: F401
from .metrics_file import METRICS_SCHEMA_VERSION
from .numerics import NumericsAccumulator
from .progress import stdout_console
from .routing_forensics import RoutingForensics
from .routing_metrics import RoutingAccumulator
from .report_request import REQUEST_KEY, ReportRequest, parse_thresholds, resolve  # noqa: F401 (parse_thresholds)
from .rundir import METRICS_FILE, SCORES, Run
from .token_context import attach_context
from .worst_tokens import DEFAULT_WORST, WorstTokens

DENSE_NOTE = "dense model: no routing"
PLAIN = dict(highlight=False, markup=False, soft_wrap=True)  # sentences quote side names and commands verbatim


@dataclass
class Comparison:
    reference: str
    candidate: str
    probability: ProbabilityAccumulator
    routing: RoutingAccumulator | None
    notes: list[str] = field(default_factory=list)
    sequences: SequenceStats | None = None  # correction what-ifs and 95% intervals
    forensics: RoutingForensics | None = None
    worst: WorstTokens | None = None
    breakdowns: Breakdowns | None = None
    numerics: NumericsAccumulator | None = None  # each side's error against an fp32 score set

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
        if self.sequences is not None:
            values, intervals = self.sequences.result(metrics)
            metrics = with_intervals(metrics | values, intervals)
        notes = list(self.notes) + (self.worst.notes if self.worst else [])
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
            "routing_forensics": self.forensics.result() if self.forensics is not None else None,
            "worst_tokens": self.worst.entries if self.worst else [],
            "breakdowns": self.breakdowns.result() if self.breakdowns else None,
        }


@dataclass
class Report:
    directory: Path
    metrics: dict
    reused_request: bool = False  # options came from the request remembered in the last metrics.json

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    @property
    def index_path(self) -> Path:
        return self.directory / "index.html"


def compute_comparisons(run: Run, pairs, thresholds, routing_scope: str, tis_caps=DEFAULT_TIS_CAPS,
                        geo_bounds=DEFAULT_GEO_BOUNDS, worst: int = DEFAULT_WORST, fp32_sides=None) -> list[Comparison]:
    """One streaming pass over every side involved; each side is read once whatever the number of pairs.
    fp32_sides: {(reference, candidate): fp32 side} for the comparisons whose error is split per side."""
    fp32_sides = fp32_sides or {}
    shape = run.manifest().routing
    comparisons = []
    for reference, candidate in pairs:
        routing = RoutingAccumulator(shape.num_layers, shape.top_k, shape.num_experts) if shape.is_moe else None
        notes = [] if shape.is_moe else [DENSE_NOTE]
        sequences = SequenceStats(thresholds, tis_caps, geo_bounds, shape.num_layers if shape.is_moe else 0)
        comparisons.append(Comparison(reference, candidate, ProbabilityAccumulator(thresholds), routing, notes, sequences,
                                      forensics=RoutingForensics(shape.num_layers) if shape.is_moe else None,
                                      worst=WorstTokens(worst, shape), breakdowns=Breakdowns(thresholds)))
        if (reference, candidate) in fp32_sides:
            comparisons[-1].numerics = NumericsAccumulator(fp32_sides[reference, candidate])
    sides = list(dict.fromkeys([side for pair in pairs for side in pair] + list(fp32_sides.values())))
    response_index = ResponseIndex()
    for chunks in aligned_chunks(run, sides, shape):
        first = chunks[sides[0]]
        index = response_index.update(first.sample_id, first.position, first.is_response)
        for comp in comparisons:
            ref, cand = chunks[comp.reference], chunks[comp.candidate]
            use = comp.probability.update(
                ref.is_response, ref.logprob, ref.logprob_valid, cand.logprob, cand.logprob_valid, ref.top, cand.top
            )
            routed = None
            if comp.routing is not None:
                scope = ref.is_response if routing_scope == "response" else np.ones(len(ref.is_response), bool)
                routed = comp.routing.update(
                    ref.sample_id, ref.experts, ref.experts_valid, cand.experts, cand.experts_valid, scope
                )
                comp.forensics.update(routed, ref.router_margin, cand.router_margin)
            comp.sequences.update(ref.sample_id, use, ref.logprob, cand.logprob, routed)
            rows, delta = compared_deltas(use, ref.logprob, cand.logprob)
            comp.worst.update(rows, delta, index, ref, cand)
            comp.breakdowns.update(rows, delta, ref.logprob, index)
            if comp.numerics is not None:
                comp.numerics.update(use, ref.logprob, cand.logprob, chunks[comp.numerics.fp32_side])
    for comp in comparisons:
        comp.sequences.finish()
        comp.worst.finish()
    attach_context(run, run.manifest().model, [comp.worst for comp in comparisons])
    return comparisons


def build_report(run_root, pairs=None, thresholds=None, routing_scope: str | None = None, tis_caps=None,
                 geo_bounds=None, worst: int | None = None) -> Report:
    """Options left None take the value the run's last report was asked for (see report_request), else
    the default. pairs: `A:B` strings or (reference, candidate) tuples replace the pairs, `+A:B` adds one."""
    from .html_report import write_index

    # matplotlib takes a quarter of a second to import: do it while the first row groups are read
    plotting = threading.Thread(target=importlib.import_module, args=("mismatch_probe.plots",), daemon=True)
    plotting.start()

    run = Run(Path(run_root))
    manifest = run.manifest()
    request, reused = resolve(run, pairs, thresholds=thresholds, routing_scope=routing_scope, tis_caps=tis_caps,
                              geo_bounds=geo_bounds, worst=worst)  # fmt: skip
    thresholds, routing_scope, worst = request.thresholds, request.routing_scope, request.worst
    tis_caps, geo_bounds = request.tis_caps, request.geo_bounds
    pairs = request.pair_list(run)
    if not pairs:
        raise ProbeError(f"{run.root / SCORES}: no score sets to compare the rollout with (run `probe rescore` first)")
    fp32_sides = numerics_plan(run, pairs)
    sides = [side for pair in pairs for side in pair] + list(fp32_sides.values())
    run.check_sides(manifest, list(dict.fromkeys(sides)))
    directory = run.report_dir
    if directory.exists() and not directory.is_dir():
        raise ProbeError(f"{directory}: exists and is not a directory; cannot write the report there")
    try:  # before the long read: an unwritable report folder should not cost a full pass
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".write-test").touch()
        (directory / ".write-test").unlink()
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report there ({exc.strerror or exc})") from exc
    comparisons = compute_comparisons(run, pairs, thresholds, routing_scope, tis_caps, geo_bounds, worst, fp32_sides)
    metrics = {
        "schema_version": METRICS_SCHEMA_VERSION,
        "comparisons": [c.to_json(routing_scope) for c in comparisons],
        REQUEST_KEY: request.to_json(),  # what a plain `probe report RUN` asks for next time
    }
    metrics["attribution"] = attribute(run, comparisons, metrics["comparisons"], request)
    try:
        plotting.join()
        from .plots import write_plots

        plots = write_plots(directory, metrics["comparisons"], [c.probability.scatter for c in comparisons])
        write_json_atomic(run.metrics_path, metrics)
        write_index(directory, run, manifest, metrics, plots)
    except OSError as exc:
        raise ProbeError(f"{directory}: cannot write the report ({exc.strerror or exc})") from exc
    return Report(directory, metrics, reused)


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
        cells = [format_with_interval(comp["metrics"].get(name), comp["metrics"].get(f"{name}_ci95")) for name in columns]
        table.add_row(f"{comp['reference']} vs {comp['candidate']}", *cells)
    out = stdout_console()
    attribution = result.metrics.get("attribution") or {}
    for line in attribution.get("headlines", []):
        out.print(f"finding: {line}", **PLAIN)
    for line in attribution.get("missing", []):
        out.print(f"missing: {line}", **PLAIN)
    out.print(table)
    for note in sorted({n for c in comparisons for n in c["notes"]}):
        out.print(f"note: {note}")
    if result.reused_request:
        request = ReportRequest.parsed(**result.metrics[REQUEST_KEY])
        out.print(f"note: as the last report of this run: {' '.join(request.options()) or 'the default pairs'} "
                  "(an option given replaces its remembered value; --pair +A:B adds a pair, --pair A:B replaces them)",
                  **PLAIN)  # fmt: skip
    out.print(f"metrics: {result.metrics_path}")
    out.print(f"report: {result.index_path}")
