"""--a and --b when not given, from the run's manifests: a is the rollout's engine configuration (the hf engine
at the rollout's dtype stands in for an engine without hooks), b the training set's of largest k3
(megatron:DTYPE for a megatron set)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.locate.spec import HOOKED, EngineSpec
from mismatch_probe.rundir.layout import Run, canonical_dtype


@dataclass(frozen=True)
class Sides:
    a: EngineSpec
    b: EngineSpec
    notes: list[str]  # lines the output shows: which configuration stands in for which


def _recorded(
    engine: str | None, dtype: str | None, model: str | None, what: str, flag: str
) -> tuple[EngineSpec, str | None]:
    """The hf spec for a recorded configuration, and a line when hf stands in for another engine."""
    canonical = canonical_dtype(dtype)
    if canonical is None:
        raise ProbeError(f"{flag}: {what} records no dtype ('{dtype}'); name the configuration, e.g. {flag} hf:bf16")
    hooked = engine if engine in HOOKED else "hf"
    spec = EngineSpec(engine=hooked, dtype=canonical, model=Path(model) if model else None)
    if engine in HOOKED:
        return spec, None
    return spec, (
        f"{flag}: {what} ran {engine or 'an unrecorded engine'}, which gives probe no hooks: "
        f"{spec.engine}:{spec.dtype} stands in for it"
    )


def resolve(run: Run, a: EngineSpec | None, b: EngineSpec | None, largest_set: str | None) -> Sides:
    """The given specs (parsed already), the rest from the manifests, each with the run's model where it names none."""
    manifest = run.manifest()
    notes = []
    if a is None:
        a, note = _recorded(manifest.engine_name, manifest.dtype, manifest.model, "the rollout", "--a")
        notes += [note] if note else []
    if b is None and largest_set is None:
        raise ProbeError(
            "--b: the run has no finished score set to take the configuration from; name one, e.g. --b hf:fp32"
        )
    if b is None:
        score = run.score_manifest(largest_set)
        b, note = _recorded(score.engine_name, score.dtype, score.model, f"scores/{largest_set}", "--b")
        notes += [note] if note else []
    return Sides(a=a.with_model(Path(manifest.model)), b=b.with_model(Path(manifest.model)), notes=notes)
