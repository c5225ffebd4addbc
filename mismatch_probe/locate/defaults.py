"""--a and --b when not given, from the run's manifests: a is the rollout's engine configuration as it ran (engine,
dtype and every engine option its manifest records: weight_quant, act_quant, kv_quant, the knobs; the hf engine at
the rollout's dtype, with the rollout's quantization, stands in for an engine without hooks), b the matched score
set's (report/verdict/matched.py's rule; megatron:DTYPE for a megatron set). Options at the engine's defaults and
those that change no number (device, logprob_chunk, parallelism) are left out of the spec. A default side equal to
the other is refused (exit 2): there would be nothing to locate. Two sides given alike still run: a determinism
check, bitwise equal (exit 1) when the engine is deterministic."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.locate.spec import HOOKED, EngineSpec, build_engine_options
from mismatch_probe.quant.served import matched_quant_args
from mismatch_probe.report.verdict.matched import Candidate, pick, plain_at_rollout_dtype
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run, canonical_dtype
from mismatch_probe.rundir.manifests import RolloutManifest
from mismatch_probe.vocab import NO_REPLAY


class SameSides(ProbeError):
    """A default side equals the other: nothing to locate (exit 2, one line)."""


@dataclass(frozen=True)
class Sides:
    a: EngineSpec
    b: EngineSpec
    notes: list[str]  # lines the output shows: which configuration stands in for which


UNRECORDED = ("device", "device_map", "logprob_chunk", "tensor_parallel", "expert_parallel")


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def recorded_args(engine: str, options: dict | None) -> tuple[tuple[str, str], ...]:
    """The options of `engine` (hf or megatron, as locate runs it) that a manifest's `engine_options` sets away from
    the engine's defaults; a nested option (megatron's override_transformer_config) as KEY.FIELD."""
    defaults = asdict(build_engine_options(engine, {}))
    out = []
    for key, value in (options or {}).items():
        if key in UNRECORDED or key not in defaults or value is None or value == defaults[key]:
            continue
        if isinstance(value, dict):
            nested = defaults[key] if isinstance(defaults[key], dict) else {}
            out += [(f"{key}.{k}", _text(v)) for k, v in value.items() if v is not None and v != nested.get(k)]
        else:
            out.append((key, _text(value)))
    return tuple(out)


def _rollout_args(manifest: RolloutManifest) -> tuple[tuple[str, str], ...]:
    """The rollout's options for the hooked stand-in: its own where hf ran it, else its recorded quantization."""
    if manifest.engine_name in HOOKED:
        return recorded_args(manifest.engine_name, manifest.engine_options)
    return tuple((matched_quant_args(manifest.quantization, manifest.model) or {}).items())


def _recorded(
    engine: str | None, dtype: str | None, model: str | None, what: str, flag: str, args: tuple = ()
) -> tuple[EngineSpec, str | None]:
    """The hf spec for a recorded configuration, and a line when hf stands in for another engine."""
    canonical = canonical_dtype(dtype)
    if canonical is None:
        raise ProbeError(f"{flag}: {what} records no dtype ('{dtype}'); name the configuration, e.g. {flag} hf:bf16")
    hooked = engine if engine in HOOKED else "hf"
    spec = EngineSpec(engine=hooked, dtype=canonical, model=Path(model) if model else None, engine_args=args)
    if engine in HOOKED:
        return spec, None
    return spec, (
        f"{flag}: {what} ran {engine or 'an unrecorded engine'}, which gives probe no hooks: "
        f"{spec.engine}:{spec.dtype} stands in for it"
    )


def matched_set(run: Run, sets: list) -> tuple[object | None, str]:
    """The matched one of locate's training sets (choose.TrainingSet, each with its k3 against the rollout) by the
    verdict's rule, and the rule's words."""
    infos = run.side_infos()
    candidates = []
    for found in sets:
        info = infos.get(f"{SCORES}/{found.name}")
        if info is None:
            continue
        candidates.append(
            Candidate(
                item=found,
                k3=found.k3,
                roles=frozenset({info.score_role}),
                replayed=info.replay != NO_REPLAY,
                plain_at_rollout_dtype=plain_at_rollout_dtype(info, infos.get(ROLLOUT)),
            )
        )
    return pick(candidates)


def resolve(run: Run, a: EngineSpec | None, b: EngineSpec | None, b_set: str | None) -> Sides:
    """The given specs (parsed already), the rest from the manifests, each with the run's model where it names none;
    b_set: the matched score set (`matched_set`)."""
    manifest = run.manifest()
    notes, defaulted = [], a is None or b is None
    if a is None:
        args = _rollout_args(manifest)
        a, note = _recorded(manifest.engine_name, manifest.dtype, manifest.model, "the rollout", "--a", args)
        notes += [note] if note else []
    if b is None and b_set is None:
        raise ProbeError(
            "--b: the run has no finished score set to take the configuration from; name one, e.g. --b hf:fp32"
        )
    if b is None:
        score = run.score_manifest(b_set)
        args = recorded_args(score.engine_name, score.engine_options) if score.engine_name in HOOKED else ()
        b, note = _recorded(score.engine_name, score.dtype, score.model, f"scores/{b_set}", "--b", args)
        notes += [note] if note else []
    sides = Sides(a=a.with_model(Path(manifest.model)), b=b.with_model(Path(manifest.model)), notes=notes)
    if defaulted and same(sides.a, sides.b):  # both given alike: a determinism check (exit 1 when bitwise)
        raise SameSides(
            f"locate: a and b are the same configuration ({sides.a.text()}): nothing differs to locate; "
            "name another with --a or --b"
        )
    return sides


def same(a: EngineSpec, b: EngineSpec) -> bool:
    """Two specs that compute alike: the same engine, dtype and model, and options that resolve alike."""
    if (a.engine, a.dtype, Path(a.model).resolve()) != (b.engine, b.dtype, Path(b.model).resolve()):
        return False
    return asdict(a.options()) == asdict(b.options())
