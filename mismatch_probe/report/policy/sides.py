"""Which sides a policy comparison reads: the rollout μ, its θ_old score set, the new pass and the natural
(replay none) new pass N of the same checkpoint, found from the score sets' manifests."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run, canonical_dtype
from mismatch_probe.rundir.manifests import ScoreManifest
from mismatch_probe.vocab import NO_REPLAY


@dataclass(frozen=True)
class PolicySides:
    candidate: str  # scores/NEW: the new policy's pass
    reference: str  # scores/OLD: its θ_old set
    replay: str  # the new pass's replay: none, r2 or r3
    step: int | None
    natural: str | None  # N: the same checkpoint's pass without replay (the candidate itself when it replays none)
    rollout: str = ROLLOUT

    @property
    def extra(self) -> tuple[str, ...]:
        """The sides read besides the compared pair."""
        return tuple(dict.fromkeys(s for s in (self.rollout, self.natural) if s not in (None, self.candidate)))


def _same_setup(a: ScoreManifest, b: ScoreManifest) -> bool:
    return a.engine_name == b.engine_name and canonical_dtype(a.dtype) == canonical_dtype(b.dtype)


def _same_weights(a: ScoreManifest, b: ScoreManifest) -> bool:
    """Both scored one checkpoint: equal weight-file hashes, or where one lacks a hash, the same model folder."""
    if a.weights_sha256 and b.weights_sha256:
        return a.weights_sha256 == b.weights_sha256
    return a.model is not None and a.model == b.model


def policy_sides(run: Run, reference: str, candidate: str) -> PolicySides | None:
    """The sides of the policy comparison (reference, candidate), or None when the candidate is no new
    policy's pass paired with this reference."""
    if not candidate.startswith(f"{SCORES}/"):
        return None
    name = candidate.removeprefix(f"{SCORES}/")
    manifest = run.score_manifest(name)
    if not manifest.is_new_policy or reference != f"{SCORES}/{manifest.policy.get('old')}":
        return None
    replay = manifest.replay or NO_REPLAY
    step = manifest.policy.get("step")
    natural = candidate if replay == NO_REPLAY else _natural(run, name, manifest, step)
    return PolicySides(candidate=candidate, reference=reference, replay=replay, step=step, natural=natural)


def _natural(run: Run, name: str, manifest: ScoreManifest, step) -> str | None:
    """The same checkpoint's replay-none pass of the same engine and dtype: a new policy's pass of the same step
    first; else, where the checkpoint is the rollout's own (step 0), a plain score set of it."""
    plain = []
    for other in run.score_sets():
        if other == name:
            continue
        theirs = run.score_manifest(other)
        if (theirs.replay or NO_REPLAY) != NO_REPLAY or not _same_setup(theirs, manifest):
            continue
        if not _same_weights(theirs, manifest):
            continue
        if theirs.is_new_policy and theirs.policy.get("step") == step:
            return f"{SCORES}/{other}"
        if not theirs.is_new_policy and not theirs.repeat_group:
            plain.append(f"{SCORES}/{other}")
    return plain[0] if plain else None


def new_policy_sets(run: Run) -> list[str]:
    """Names of the score sets that are new policies' passes."""
    return [name for name in run.score_sets() if run.score_manifest(name).is_new_policy]
