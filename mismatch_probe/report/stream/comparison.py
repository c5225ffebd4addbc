"""One compared pair of sides: its accumulators, fed one PairFrame per chunk, and its part of metrics.json.

Every number comes from exactly one accumulator; `to_json` only gathers their `finish()` parts and puts
the headline keys in the order of SPEC section 5, each interval right after its key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from mismatch_probe.frames.bootstrap import CI_SUFFIX
from mismatch_probe.frames.pair_frame import PairFrame
from mismatch_probe.report.accumulators.base import Accumulator
from mismatch_probe.report.accumulators.breakdowns import Breakdowns
from mismatch_probe.report.accumulators.error_split import ErrorSplitAccumulator
from mismatch_probe.report.accumulators.kept_mass import N_OUTSIDE_SUPPORT, KeptMassAccumulator
from mismatch_probe.report.accumulators.position_profile import PROFILE, PositionProfile
from mismatch_probe.report.accumulators.probability import ProbabilityAccumulator
from mismatch_probe.report.accumulators.routing import RoutingAccumulator
from mismatch_probe.report.accumulators.routing_forensics import RoutingForensics
from mismatch_probe.report.accumulators.sequence_stats import ROUTING_ROWS, SequenceStats, judging_rows
from mismatch_probe.report.accumulators.worst_tokens import WorstTokens
from mismatch_probe.report.keys.catalogue import names, rank
from mismatch_probe.report.keys.request import ReportRequest
from mismatch_probe.report.policy.accumulator import PolicyStats
from mismatch_probe.report.policy.router_shift import SHIFT_ROWS, shift_rows
from mismatch_probe.report.policy.sides import PolicySides
from mismatch_probe.report.steps.ranges import StepRanges
from mismatch_probe.report.steps.split import StepSplit
from mismatch_probe.schema import RoutingShape

DENSE_NOTE = "dense model: no routing"
POLICY_FIELDS = ("kind", "replay", "policy_step", "natural")  # a policy comparison's, beside its metrics
# Null on a dense model rather than absent, so a gate or compare on routing keys reads "skipped", not "unknown".
ROUTING_KEYS = names("routing")


def ordered(metrics: dict) -> dict:
    """Keys in catalogue order; keys of one rank keep the order they were made in: a key before its
    interval, thresholds as given."""
    return {key: metrics[key] for key in sorted(metrics, key=lambda key: rank(key.removesuffix(CI_SUFFIX)))}


@dataclass
class Comparison:
    reference: str
    candidate: str
    probability: ProbabilityAccumulator
    sequences: SequenceStats  # every key with a 95% interval, and the correction what-ifs
    breakdowns: Breakdowns
    worst: WorstTokens
    routing: RoutingAccumulator | None = None  # None for a dense model
    forensics: RoutingForensics | None = None
    error_split: ErrorSplitAccumulator | None = None  # each side's error against an fp32 score set
    steps: StepSplit | None = None  # per RL step, when the run records steps
    policy: PolicyStats | None = None  # a new policy's pass against its θ_old set (report/policy/)
    # truncated sampling: keys only where a side records kept_logmass (report/accumulators/kept_mass.py)
    kept_mass: KeptMassAccumulator = field(default_factory=KeptMassAccumulator)
    # mean |delta| by absolute position: the rollout's comparisons in a run with an engine-prefill set
    positions: PositionProfile | None = None
    notes: list[str] = field(default_factory=list)
    parts: list[dict] = field(default_factory=list)  # each accumulator's finish(), once finished

    @classmethod
    def new(
        cls,
        reference: str,
        candidate: str,
        shape: RoutingShape,
        request: ReportRequest,
        *,
        fp32_side: str | None = None,
        steps: StepRanges | None = None,
        policy: PolicySides | None = None,
        processed: frozenset[str] = frozenset(),
        by_position: bool = False,
        against_prefill: bool = False,
    ) -> Comparison:
        """Empty accumulators, each built from the request's options it needs. processed: the run's sides whose
        manifest declares processed log-probs (renormalised over a truncated support)."""
        moe = shape.is_moe
        layers = shape.num_layers if moe else 0
        return cls(
            reference=reference,
            candidate=candidate,
            probability=ProbabilityAccumulator(),
            sequences=SequenceStats(
                thresholds=request.thresholds,
                tis_caps=request.tis_caps,
                geo_bounds=request.geo_bounds,
                num_layers=layers,
            ),
            breakdowns=Breakdowns(thresholds=request.thresholds),
            worst=WorstTokens(limit=request.worst),
            routing=RoutingAccumulator(num_layers=shape.num_layers, top_k=shape.top_k) if moe else None,
            forensics=RoutingForensics(num_layers=shape.num_layers) if moe else None,
            error_split=ErrorSplitAccumulator(fp32_side=fp32_side) if fp32_side else None,
            steps=StepSplit(ranges=steps, num_layers=layers, min_ratio=request.drift_ratio)
            if steps is not None
            else None,
            notes=[] if moe else [DENSE_NOTE],
            policy=PolicyStats(
                sides=policy, num_layers=layers, tis_caps=request.tis_caps, ppo_bounds=request.ppo_bounds
            )
            if policy is not None
            else None,
            kept_mass=KeptMassAccumulator(processed=(reference in processed, candidate in processed)),
            positions=PositionProfile(against_prefill=against_prefill) if by_position else None,
        )

    @property
    def label(self) -> str:
        return f"{self.reference} vs {self.candidate}"

    @property
    def sides(self) -> tuple[str, str, str | None, tuple[str, ...]]:
        """(reference, candidate, fp32 side or None, extra sides): what its frames are built from."""
        extra = self.policy.sides.extra if self.policy else ()
        return self.reference, self.candidate, self.error_split.fp32_side if self.error_split else None, extra

    def row_functions(self) -> dict:
        """What its accumulators read at routing row p - 1 (PairFrame.before): routing alike, router shift."""
        functions = {ROUTING_ROWS: judging_rows} if self.routing is not None else {}
        if self.policy is not None and self.policy.shift is not None:
            functions[SHIFT_ROWS] = partial(shift_rows, sides=self.policy.sides)
        return functions

    def accumulators(self) -> list[Accumulator]:
        every = (
            self.probability,
            self.steps,  # before `sequences`: it draws the chunk's bootstrap weights, which `sequences` reuses
            self.sequences,
            self.routing,
            self.forensics,
            self.breakdowns,
            self.worst,
            self.error_split,
            self.policy,
            self.kept_mass,
            self.positions,
        )
        return [acc for acc in every if acc is not None]

    def update(self, frame: PairFrame) -> None:
        for acc in self.accumulators():
            acc.update(frame)

    def merge(self, other: Comparison) -> None:
        """Add the accumulators of the same comparison over another range of rows."""
        for mine, theirs in zip(self.accumulators(), other.accumulators(), strict=True):
            mine.merge(theirs)

    def finish(self) -> None:
        self.parts = [acc.finish() for acc in self.accumulators()]

    def to_json(self, routing_scope: str) -> dict:
        metrics, part = {}, {}
        for piece in self.parts:
            metrics |= piece.get("metrics", {})
            part |= {key: value for key, value in piece.items() if key != "metrics"}
        metrics = ordered({key: None for key in ROUTING_KEYS} | metrics)
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "metrics": metrics,
            "routing_scope": routing_scope,
            "notes": self.notes + self.worst.notes + self._data_notes(metrics),
            "extreme_fraction_curve": part["extreme_fraction_curve"],
            "routing_histograms": part.get("routing_histograms"),
            "routing_forensics": part.get("routing_forensics"),
            "worst_tokens": part["worst_tokens"],
            "breakdowns": part["breakdowns"],
        } | {
            key: part[key]
            for key in POLICY_FIELDS + ("steps", "drift", "trend", "change_point", PROFILE)
            if key in part
        }

    def _data_notes(self, metrics: dict) -> list[str]:
        notes = []
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
        if metrics.get(N_OUTSIDE_SUPPORT):
            notes.append(
                f"{metrics[N_OUTSIDE_SUPPORT]} sampled tokens lie outside a side's own top-p/top-k support "
                f"(--sampling rollout): no log-prob there, left out of the means ({N_OUTSIDE_SUPPORT})"
            )
        return notes
