"""The streaming pass of a report over one unit of a run: every side involved read once, each chunk's frames
fed to every comparison's accumulators. What a worker process or a Ray task runs; the driver merges the
units' comparisons (report/stream/workers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.doctor.state import Doctor
from mismatch_probe.frames.align import aligned_chunks
from mismatch_probe.frames.pair_frame import FrameBuilder, PairFrame
from mismatch_probe.report.keys.request import ReportRequest
from mismatch_probe.report.policy.sides import policy_sides
from mismatch_probe.report.steps.ranges import step_ranges
from mismatch_probe.report.stream.comparison import Comparison
from mismatch_probe.report.stream.plan import WHOLE, Unit
from mismatch_probe.rundir.layout import MANIFEST, ROLLOUT, SCORES, Run
from mismatch_probe.vocab import ENGINE_PREFILL, PROCESSED


def new_comparisons(run: Run, pairs, request: ReportRequest, *, fp32_sides=None) -> list[Comparison]:
    """Empty accumulators for each pair, built from the request's options. fp32_sides: {(reference, candidate):
    fp32 side} for the comparisons whose error is split per side. A run that records steps gets each comparison
    split per step."""
    manifest, fp32_sides = run.manifest(), fp32_sides or {}
    shape, steps = manifest.routing, step_ranges(manifest, str(run.root / MANIFEST))
    processed = processed_sides(run, {side for pair in pairs for side in pair})
    prefills = {f"{SCORES}/{n}" for n in run.score_sets() if run.score_manifest(n).kind == ENGINE_PREFILL}
    return [
        Comparison.new(
            reference,
            candidate,
            shape,
            request,
            fp32_side=fp32_sides.get((reference, candidate)),
            steps=steps,
            policy=policy_sides(run, reference, candidate) if reference != ROLLOUT else None,
            processed=processed,
            by_position=bool(prefills) and reference == ROLLOUT,
            against_prefill=candidate in prefills,
        )
        for reference, candidate in pairs
    ]


def processed_sides(run: Run, sides) -> frozenset[str]:
    """The sides whose manifest's `sampling` declares processed log-probs: renormalised over a top-p/top-k
    support, so a sampled token outside it has none (the report counts those as n_outside_support)."""
    found = set()
    for side in sides:
        m = run.manifest() if side == ROLLOUT else run.score_manifest(side.removeprefix(f"{SCORES}/"))
        sampling = m.sampling if isinstance(m.sampling, dict) else {}
        if sampling.get("logprobs_mode") == PROCESSED:
            found.add(side)
    return frozenset(found)


def scan_sides(comparisons: list[Comparison]) -> list[str]:
    """Every side the comparisons read, each once, in first-use order (the first is the one rows are checked against)."""
    keys = [comp.sides for comp in comparisons]
    firsts = [side for key in keys for side in key[:2]]
    return list(dict.fromkeys(firsts + [key[2] for key in keys if key[2]] + [s for key in keys for s in key[3]]))


def chunk_frames(
    run: Run, comparisons: list[Comparison], routing_scope: str, unit: Unit = WHOLE
) -> Iterator[list[PairFrame]]:
    """Per chunk of aligned rows, one frame per comparison. Each side is read once whatever the number of pairs.
    A unit starts at a sequence's first row, so its response index starts afresh."""
    shape = run.manifest().routing
    builder = FrameBuilder(shape=shape, routing_scope=routing_scope)
    keys = [comp.sides for comp in comparisons]
    row_functions = [comp.row_functions() for comp in comparisons]
    for chunks in aligned_chunks(run, scan_sides(comparisons), shape, unit.samples):
        yield builder.frames(chunks, keys, row_functions)


@dataclass(frozen=True, kw_only=True)
class ScanJob:
    """Everything a worker needs to scan a unit: plain values, pickled to the worker."""

    run_root: Path
    pairs: list[tuple[str, str]]
    request: ReportRequest  # the options: thresholds, routing scope, caps, bounds, worst, drift ratio, PPO bounds
    fp32_sides: dict | None = None
    doctor: bool = False  # run `probe doctor`'s checks in the same pass

    def new_comparisons(self, run: Run) -> list[Comparison]:
        return new_comparisons(run, self.pairs, self.request, fp32_sides=self.fp32_sides)


@dataclass(kw_only=True)
class UnitScan:
    """One unit's accumulators, not finished: the comparisons' and, when asked, the doctor's."""

    comparisons: list[Comparison]
    doctor: Doctor | None = None

    def merge(self, other: UnitScan) -> None:
        for comp, theirs in zip(self.comparisons, other.comparisons, strict=True):
            comp.merge(theirs)
        if self.doctor is not None:
            self.doctor.merge(other.doctor)


def scan_unit(job: ScanJob, unit: Unit) -> UnitScan:
    """The accumulators over one unit, not finished: the driver merges them."""
    run = Run(job.run_root)
    comparisons = job.new_comparisons(run)
    doctor = Doctor(run, job.pairs) if job.doctor else None
    for frames in chunk_frames(run, comparisons, job.request.routing_scope, unit):
        for comp, frame in zip(comparisons, frames):
            comp.update(frame)
        if doctor is not None:
            doctor.update(frames)
    return UnitScan(comparisons=comparisons, doctor=doctor)
