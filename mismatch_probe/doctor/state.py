"""The doctor's streaming state over one run: one PairStats per comparison, one SideStats per side.

`update(frames)` takes the frames the report builds for a chunk (one per comparison, in the order of the
pairs), so the checks run inside the report's single pass or in a pass of their own; `merge` adds the
state of another range of rows; `findings()` applies the rules once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mismatch_probe.doctor.finding import Finding
from mismatch_probe.doctor.rules import engine_rules, setup_checks
from mismatch_probe.doctor.rules.setup_rules import Diagnosis, RunFacts, SideFacts
from mismatch_probe.doctor.stats.decode_cache import cache_split
from mismatch_probe.doctor.stats.duplicates import SampleDigests
from mismatch_probe.doctor.stats.first_token import FirstTokens
from mismatch_probe.doctor.stats.onset import PositionLevels
from mismatch_probe.doctor.stats.pair_stats import PairStats
from mismatch_probe.doctor.stats.routes_stats import LayerDiffs, RouteStats, route_sample_rate
from mismatch_probe.doctor.stats.side_stats import SideStats
from mismatch_probe.doctor.stats.transport import RunFit
from mismatch_probe.jsonfile import read_json
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run
from mismatch_probe.schema import KEPT_LOGMASS
from mismatch_probe.vocab import ENGINE_PREFILL, FINGERPRINT_KEY

FINDINGS_KEY = "findings"  # metrics.json's list of findings


def eos_ids(model_path: str | None) -> set[int]:
    """The model's end tokens from its config files, when the checkpoint is still where the run says."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path or "") / name
        if model_path and path.is_file():
            value = read_json(path).get("eos_token_id")
            ids |= {int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)}
    return ids


def _temperature(value) -> float | None:
    """The sampling temperature, or None where the run does not know it (an imported dump that records none)."""
    return None if value is None else float(value)


def mean_kept_logmass(run: Run, side: str) -> float | None:
    """The mean of a side's recorded kept_logmass over its response rows; None where it records none."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    files = sorted(str(p) for p in (run.root / side).glob("*.parquet"))
    if not files:
        return None
    dataset = ds.dataset(files, format="parquet")
    if KEPT_LOGMASS not in dataset.schema.names:
        return None
    total, n = 0.0, 0
    for batch in dataset.to_batches(columns=[KEPT_LOGMASS], filter=ds.field("is_response")):
        column = batch.column(0)
        n += len(column) - column.null_count
        total += float(pc.sum(column).as_py() or 0.0)
    return total / n if n else None


@dataclass
class KeptMass:
    """Each side's mean recorded kept_logmass, read on first use (only the truncation rule needs it). An object,
    not a closure, so that the doctor's state pickles to the report's worker processes."""

    run: Run
    means: dict[str, float | None] = field(default_factory=dict)

    def __call__(self, side: str) -> float | None:
        if side not in self.means:
            self.means[side] = mean_kept_logmass(self.run, side)
        return self.means[side]


def run_facts(run: Run, sides: list[str]) -> RunFacts:
    manifest = run.manifest()
    sampling = manifest.sampling or {}
    facts = RunFacts(
        temperature=_temperature(sampling.get("temperature", manifest.scoring_temperature)),
        top_k=int(sampling.get("top_k") or 0),
        top_p=float(1.0 if sampling.get("top_p") is None else sampling["top_p"]),
        kept_logmass=KeptMass(run=run),
    )
    for side in sides:
        m = manifest if side == ROLLOUT else run.score_manifest(side.split("/", 1)[1])
        engine = m.engine if isinstance(m.engine, dict) else {}
        facts.sides[side] = SideFacts(
            name=side,
            dtype=m.dtype or engine.get("dtype"),
            fingerprint=engine.get(FINGERPRINT_KEY),
            repeat_group=getattr(m, "repeat_group", None),
            logprobs_mode=(getattr(m, "sampling", None) or {}).get("logprobs_mode"),
            quantization=getattr(m, "quantization", None),
            kind=getattr(m, "kind", None),
        )
    return facts


def _new_policy(run: Run, side: str) -> bool:
    return side.startswith(f"{SCORES}/") and run.score_manifest(side.removeprefix(f"{SCORES}/")).is_new_policy


class Doctor:
    def __init__(self, run: Run, pairs: list[tuple[str, str]]):
        self.run = run
        self.pairs = list(pairs)
        self.sides = list(dict.fromkeys(side for pair in self.pairs for side in pair))
        self.facts = run_facts(run, self.sides)
        # A new policy's pass against its θ_old set measures staleness, not a setup bug: its weights differ on
        # purpose (docs/staleness.md). Its sides are still read, for the side checks.
        self.policy_pairs = {pair for pair in self.pairs if _new_policy(run, pair[1])}
        manifest = run.manifest()
        # The end ids the rollout recorded (model/generation.py); a run that records none (older runs, imported
        # dumps) uses its checkpoint's config files, when the checkpoint is still where the run says.
        eos = set(manifest.eos_token_ids) if manifest.eos_token_ids is not None else eos_ids(manifest.model)
        self.shape = manifest.routing
        indices = list(manifest.moe_layer_indices or [])  # model layer of each stored MoE layer, where known
        self.model_layers = indices if len(indices) == self.shape.num_layers else list(range(self.shape.num_layers))
        self.pair_stats = [PairStats() for _ in self.pairs]
        # the second round's per-comparison sums: routes per layer, |delta| per position, runs of each side
        self.layer_diffs = [LayerDiffs(self.shape.num_layers) for _ in self.pairs] if self.shape.is_moe else []
        self.positions = [PositionLevels() for _ in self.pairs]
        self.first_tokens = [FirstTokens() for _ in self.pairs]
        self.run_fits = [(RunFit("ref"), RunFit("cand")) for _ in self.pairs]
        self.side_stats, self.route_stats = {}, {}
        rate = route_sample_rate(run, self.shape.num_layers) if self.shape.is_moe else 1
        for side in self.sides:  # each side is read from the first frame that holds it
            index = next(i for i, pair in enumerate(self.pairs) if side in pair)
            role = "ref" if self.pairs[index][0] == side else "cand"
            self.side_stats[side] = SideStats(role=role, pair_index=index, eos_ids=eos if side == ROLLOUT else ())
            if self.shape.is_moe:
                self.route_stats[side] = RouteStats(
                    role=role, pair_index=index, num_layers=self.shape.num_layers,
                    num_experts=self.shape.num_experts, rate=rate,
                )  # fmt: skip
        rollout = next((i for i, pair in enumerate(self.pairs) if ROLLOUT in pair), None)
        self.digests = SampleDigests(pair_index=rollout) if rollout is not None else None

    def _accumulators(self) -> list:
        """Every accumulator with the index of the frame it reads, in a fixed order (for update and merge)."""
        out = [(i, stats) for i, stats in enumerate(self.pair_stats)]
        out += [(i, stats) for i, stats in enumerate(self.layer_diffs)]
        out += [(i, stats) for i, stats in enumerate(self.positions)]
        out += [(i, stats) for i, stats in enumerate(self.first_tokens)]
        out += [(i, fit) for i, fits in enumerate(self.run_fits) for fit in fits]
        out += [(stats.pair_index, stats) for stats in (*self.side_stats.values(), *self.route_stats.values())]
        return out + ([(self.digests.pair_index, self.digests)] if self.digests else [])

    def out_of_range(self, chunks: dict) -> bool:
        """Count each side's expert ids >= num_experts (every row) and set them to num_experts; whether any was."""
        found = False
        for side, stats in self.route_stats.items():
            chunk = chunks[side]
            if chunk.experts is not None and stats.count_out_of_range(chunk):
                chunk.experts = np.minimum(chunk.experts, self.shape.num_experts).astype(chunk.experts.dtype)
                found = True
        return found

    def update(self, frames: list) -> None:
        if len(frames) != len(self.pairs):
            raise ValueError(f"doctor: {len(frames)} frames for {len(self.pairs)} comparisons")
        for index, stats in self._accumulators():
            stats.update(frames[index])

    def merge(self, other: Doctor) -> None:
        for (_, mine), (_, theirs) in zip(self._accumulators(), other._accumulators(), strict=True):
            mine.merge(theirs)

    def findings(self) -> list[Finding]:
        diagnosis = Diagnosis(facts=self.facts)
        diagnosis.greedy()
        for side, stats in self.side_stats.items():
            diagnosis.side(side, stats.finish())
        route = {side: stats.finish(self.shape.top_k) for side, stats in self.route_stats.items()}
        constant = engine_rules.constant_layers(route, self.pairs)
        engine_rules.routes_constant(diagnosis, route, constant, self.model_layers)
        setup_checks.quantization(diagnosis, [pair for pair in self.pairs if pair not in self.policy_pairs])
        invalid = engine_rules.routes_invalid(diagnosis, route, constant, self.shape.top_k, self.shape.num_experts)
        sums = [stats.finish() for stats in self.pair_stats]
        floor = self._noise_floor(sums)
        for i, ((ref, cand), s) in enumerate(zip(self.pairs, sums)):
            if (ref, cand) in self.policy_pairs:
                continue
            extra = {
                "runs": {fit.role: fit.finish() for fit in self.run_fits[i]},
                "positions": self.positions[i].finish()["position_sums"],
                "first": self.first_tokens[i].finish(),
            }
            if ref == ROLLOUT and self.facts.sides[cand].kind == ENGINE_PREFILL:  # decode against its prefill
                extra["cache"] = cache_split(self.run, cand)
            if self.layer_diffs:
                skip = {layer for side in (ref, cand) for named in (constant, invalid) for layer in named.get(side, [])}
                extra |= {"layers": self.layer_diffs[i].finish(), "route_skip": skip, "model_layers": self.model_layers}
            diagnosis.comparison(ref, cand, s, floor, extra)
        if self.digests is not None:
            engine_rules.duplicates(diagnosis, ROLLOUT, self.digests.finish(), self.facts.temperature)
        return diagnosis.settle()

    def _noise_floor(self, sums: list[dict]) -> float | None:
        """The largest k3 between repeated passes of one score set: the training side's own noise."""
        floors = [
            s["k3"] / s["n"]
            for (ref, cand), s in zip(self.pairs, sums)
            if s.get("n")
            and self.facts.sides[ref].repeat_group
            and self.facts.sides[ref].repeat_group == self.facts.sides[cand].repeat_group
        ]
        return max(floors) if floors else None
