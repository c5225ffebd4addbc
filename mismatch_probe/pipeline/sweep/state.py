"""Whether a sweep's score set or sibling run already exists as the sweep would make it: reused when complete,
resumed when interrupted, refused (or, with --overwrite, replaced) when it was made otherwise.

A score set matches on what `probe rescore` records: engine, dtype, every engine option (`engine_options`),
no replay, one pass, raw sampling, no new policy, and the rollout it scored (`rollout_created_at`, config hash).
A sibling run matches on its rollout manifest: engine, dtype, engine options, sampling, seed, prompts and counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.layout import MANIFEST, Run
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest, ScoreManifest
from mismatch_probe.rundir.parts import part_files
from mismatch_probe.vocab import NO_REPLAY, RAW

ABSENT, REUSE, RESUME, STALE = "absent", "reuse", "resume", "stale"
FINISH = "finish"  # every part written, the manifest still running: interrupted after its last part


@dataclass(frozen=True, kw_only=True)
class State:
    kind: str  # absent, reuse, resume, finish or stale
    why: str = ""  # for stale: the first setting that differs

    def refuse(self, what: str, path: Path) -> ProbeError:
        return ProbeError(f"{path}: {what} exists but was made otherwise ({self.why}); remove it or pass --overwrite")


def plain(value):
    """`value` as JSON reads it back (tuples as lists), so live settings compare with recorded ones."""
    return json.loads(json.dumps(value))


def _first_difference(have: dict, want: dict, prefix: str = "") -> str:
    """The first key whose value differs, as `key: recorded, this sweep: wanted` (a dict's differing entry)."""
    for key, value in want.items():
        mine = have.get(key) if isinstance(have, dict) else None
        if plain(mine) == plain(value):
            continue
        if isinstance(mine, dict) and isinstance(value, dict):
            return _first_difference(mine, value | {k: None for k in mine if k not in value}, f"{prefix}{key}.")
        return f"{prefix}{key}: {mine!r}, this sweep: {value!r}"
    return ""


def score_state(run: Run, name: str, engine: str, dtype: str, options: dict) -> State:
    """The state of RUN/scores/NAME against a plain pass of `engine` at `dtype` with these resolved options."""
    folder = run.score_dir(name)
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return State(kind=ABSENT)
    if not (folder / MANIFEST).is_file():
        return State(kind=STALE, why="no manifest.json")
    have = run.score_manifest(name)
    rollout = run.manifest()
    sampling = have.sampling or {}
    recorded = {
        "engine": have.engine_name,
        "dtype": have.dtype,
        "engine_options": have.engine_options,
        "replay": have.replay or NO_REPLAY,
        "repeats": have.repeats or 1,
        "policy": have.policy,
        "logprobs_mode": sampling.get("logprobs_mode", RAW),
        "rollout_created_at": have.rollout_created_at,
        "config_hash": have.config_hash,
    }
    wanted = {
        "engine": engine,
        "dtype": dtype,
        "engine_options": options,
        "replay": NO_REPLAY,
        "repeats": 1,
        "policy": None,
        "logprobs_mode": RAW,
        "rollout_created_at": rollout.created_at,
        "config_hash": rollout.config_hash,
    }
    why = _first_difference(recorded, wanted)
    if why:
        return State(kind=STALE, why=why)
    if _part_names(folder) != _part_names(run.rollout_dir):
        return State(kind=RESUME)
    return State(kind=REUSE if have.status == COMPLETE else FINISH)


def rollout_state(folder: Path, wanted: dict) -> State:
    """The state of a sibling run against the rollout-manifest values the sweep would write for it (`wanted`,
    keyed by manifest field; `engine` is the engine's name)."""
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return State(kind=ABSENT)
    if not (folder / MANIFEST).is_file():
        return State(kind=STALE, why="no manifest.json")
    have = RolloutManifest.load(folder / MANIFEST)
    recorded = {key: have.engine_name if key == "engine" else getattr(have, key) for key in wanted}
    why = _first_difference(recorded, wanted)
    if why:
        return State(kind=STALE, why=why)
    return State(kind=REUSE if have.status == COMPLETE else RESUME)


def _part_names(folder: Path) -> list[str]:
    return [p.name for p in part_files(folder)]


def score_set_manifest(run: Run, name: str) -> ScoreManifest | None:
    """A finished score set's manifest, None when it is absent or unfinished."""
    path = run.score_dir(name) / MANIFEST
    if not path.is_file():
        return None
    manifest = ScoreManifest.load(path)
    return manifest if manifest.status == COMPLETE else None
