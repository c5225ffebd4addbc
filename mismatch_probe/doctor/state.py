"""The doctor's streaming state over one run: one PairStats per comparison, one SideStats per side.

`update(frames)` takes the frames the report builds for a chunk (one per comparison, in the order of the
pairs), so the checks run inside the report's single pass or in a pass of their own; `merge` adds the
state of another range of rows; `findings()` applies the rules once at the end.
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.doctor.finding import Finding
from mismatch_probe.doctor.pair_stats import PairStats
from mismatch_probe.doctor.rules import Diagnosis, RunFacts, SideFacts
from mismatch_probe.doctor.side_stats import SideStats
from mismatch_probe.jsonfile import read_json
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run
from mismatch_probe.vocab import FINGERPRINT_KEY

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


def run_facts(run: Run, sides: list[str]) -> RunFacts:
    manifest = run.manifest()
    sampling = manifest.sampling or {}
    facts = RunFacts(
        temperature=_temperature(sampling.get("temperature", manifest.scoring_temperature)),
        top_k=int(sampling.get("top_k") or 0),
        top_p=float(sampling.get("top_p") or 1.0),
    )
    for side in sides:
        m = manifest if side == ROLLOUT else run.score_manifest(side.split("/", 1)[1])
        engine = m.engine if isinstance(m.engine, dict) else {}
        facts.sides[side] = SideFacts(
            name=side,
            dtype=m.dtype or engine.get("dtype"),
            fingerprint=engine.get(FINGERPRINT_KEY),
            repeat_group=getattr(m, "repeat_group", None),
        )
    return facts


def _new_policy(run: Run, side: str) -> bool:
    return side.startswith(f"{SCORES}/") and run.score_manifest(side.removeprefix(f"{SCORES}/")).is_new_policy


class Doctor:
    def __init__(self, run: Run, pairs: list[tuple[str, str]]):
        self.pairs = list(pairs)
        self.sides = list(dict.fromkeys(side for pair in self.pairs for side in pair))
        self.facts = run_facts(run, self.sides)
        # A new policy's pass against its θ_old set measures staleness, not a setup bug: its weights differ on
        # purpose (docs/staleness.md). Its sides are still read, for the side checks.
        self.policy_pairs = {pair for pair in self.pairs if _new_policy(run, pair[1])}
        eos = eos_ids(run.manifest().model)
        self.pair_stats = [PairStats() for _ in self.pairs]
        self.side_stats = {}
        for side in self.sides:  # each side is read from the first frame that holds it
            index = next(i for i, pair in enumerate(self.pairs) if side in pair)
            role = "ref" if self.pairs[index][0] == side else "cand"
            self.side_stats[side] = SideStats(role=role, pair_index=index, eos_ids=eos if side == ROLLOUT else ())

    def update(self, frames: list) -> None:
        for stats, frame in zip(self.pair_stats, frames, strict=True):
            stats.update(frame)
        for stats in self.side_stats.values():
            stats.update(frames[stats.pair_index])

    def merge(self, other: Doctor) -> None:
        for mine, theirs in zip(self.pair_stats, other.pair_stats, strict=True):
            mine.merge(theirs)
        for side, stats in self.side_stats.items():
            stats.merge(other.side_stats[side])

    def findings(self) -> list[Finding]:
        diagnosis = Diagnosis(facts=self.facts)
        diagnosis.greedy()
        for side, stats in self.side_stats.items():
            diagnosis.side(side, stats.finish())
        sums = [stats.finish() for stats in self.pair_stats]
        floor = self._noise_floor(sums)
        for (ref, cand), s in zip(self.pairs, sums):
            if (ref, cand) not in self.policy_pairs:
                diagnosis.comparison(ref, cand, s, floor)
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
