"""Which sequences both configurations score: the run's worst N by per-sequence k3 against the matched training
set (defaults.matched_set), and N more drawn with a fixed seed from the rest. Read from the part files, three columns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import iter_score_requests, part_files, read_part
from mismatch_probe.rundir.records import ScoreRequest

SEED = 0
COLUMNS = ["sample_id", "is_response", "logprob"]


@dataclass(frozen=True)
class TrainingSet:
    name: str
    k3: float  # mean over compared response tokens
    sample_ids: np.ndarray  # the sequences compared, ascending
    sequence_k3: np.ndarray  # their mean k3


@dataclass(frozen=True)
class Choice:
    worst: list[int]
    sampled: list[int]
    ranked_by: str | None  # the training set the worst ones are ranked by

    @property
    def sample_ids(self) -> list[int]:
        return sorted(self.worst + self.sampled)


def _columns(directory) -> dict[str, np.ndarray]:
    tables = [read_part(path, COLUMNS) for path in part_files(directory)]
    if not tables:
        raise ProbeError(f"{directory}: no part-*.parquet files (empty or unfinished run)")
    out = {}
    for name in COLUMNS:
        arrays = [t.column(name).to_numpy(zero_copy_only=False) for t in tables]
        out[name] = np.concatenate(arrays)
    out["logprob"] = out["logprob"].astype(np.float64)  # a null log-prob reads as nan: not compared
    return out


def training_sets(run: Run) -> list[TrainingSet]:
    """Every finished score set of the rollout's own checkpoint whose rows line up with the rollout's, with its
    k3 against the rollout. Sets at a new policy's checkpoint are left out: they differ by the weights."""
    rollout = _columns(run.rollout_dir)
    found = []
    for name in run.score_sets():
        manifest = run.score_manifest(name)
        if manifest.status != "complete" or manifest.is_new_policy:
            continue
        scores = _columns(run.score_dir(name))
        if len(scores["sample_id"]) != len(rollout["sample_id"]) or not np.array_equal(
            scores["sample_id"], rollout["sample_id"]
        ):
            continue
        found.append(_k3(name, rollout, scores))
    return found


def _k3(name: str, rollout: dict, scores: dict) -> TrainingSet:
    use = rollout["is_response"] & np.isfinite(rollout["logprob"]) & np.isfinite(scores["logprob"])
    delta = scores["logprob"][use] - rollout["logprob"][use]
    k3 = np.expm1(delta) - delta
    ids, where = np.unique(rollout["sample_id"][use], return_inverse=True)
    sums = np.bincount(where, weights=k3, minlength=len(ids))
    counts = np.bincount(where, minlength=len(ids))
    return TrainingSet(name=name, k3=float(k3.mean()) if k3.size else 0.0, sample_ids=ids, sequence_k3=sums / counts)


def largest(sets: list[TrainingSet]) -> TrainingSet | None:
    return max(sets, key=lambda s: (s.k3, s.name)) if sets else None


def choose(run: Run, ranked: TrainingSet | None, worst: int, samples: int) -> Choice:
    """The worst `worst` sequences of `ranked` (none without a training set) and `samples` drawn from the rest."""
    every = np.unique(read_ids(run))
    picked: list[int] = []
    if ranked is not None and worst:
        order = np.lexsort((ranked.sample_ids, -ranked.sequence_k3))  # largest k3 first, ties by sample id
        picked = [int(i) for i in ranked.sample_ids[order[:worst]]]
    rest = np.setdiff1d(every, np.array(picked, dtype=every.dtype))
    drawn = np.random.default_rng(SEED).choice(rest, size=min(samples, len(rest)), replace=False) if samples else []
    return Choice(worst=picked, sampled=sorted(int(i) for i in drawn), ranked_by=ranked.name if ranked else None)


def read_ids(run: Run) -> np.ndarray:
    return np.concatenate([read_part(p, ["sample_id"]).column(0).to_numpy() for p in part_files(run.rollout_dir)])


def requests(run: Run, sample_ids: list[int]) -> list[ScoreRequest]:
    """The chosen sequences' stored token ids, in sample-id order."""
    wanted = set(sample_ids)
    shape = run.manifest().routing
    out = [r for _, batch in iter_score_requests(run.rollout_dir, shape, False) for r in batch if r.sample_id in wanted]
    return sorted(out, key=lambda r: r.sample_id)
