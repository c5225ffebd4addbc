"""A score set's role: the training side as the team runs it (`matched`), or a diagnostic pass.

A run holds many score sets (fp32, R3, repeated passes, quantized, truncated, sweep variants); only one of them is
what the team trains with. The verdict, the report's first screen and `probe locate`'s default side b speak of
that one (report/verdict/matched.py chooses it). The score-set manifest records `role`: `probe diagnose` and
`probe sweep` set it, `probe rescore` sets the diagnostic role its options imply, `--role` sets it by hand, and
an import marks the framework's own training log-probs `matched`. A run written before roles has none: its role
is read from what the manifest records instead (`recorded_role`).
"""

from __future__ import annotations

from mismatch_probe.errors import ProbeError
from mismatch_probe.vocab import ENGINE_PREFILL, NO_REPLAY, RAW  # ENGINE_PREFILL: a score-set kind, and its role

MATCHED = "matched"
FP32, R3, R2, REPEATS, QUANT, SAMPLING, SWEEP, POLICY = (
    "fp32",
    "r3",
    "r2",
    "repeats",
    "quant",
    "sampling",
    "sweep",
    "policy",
)
DIAGNOSTIC = "diagnostic"  # a diagnostic set of no named kind (--role)
DIAGNOSTIC_ROLES = (FP32, R3, R2, REPEATS, QUANT, SAMPLING, SWEEP, POLICY, ENGINE_PREFILL, DIAGNOSTIC)
ROLES = (MATCHED, *DIAGNOSTIC_ROLES)
QUANT_OPTIONS = ("weight_quant", "act_quant", "kv_quant")
SWEEP_MARK = "+"  # a sweep variant's score set is BASE+KNOB-VALUE (pipeline/sweep/plan.py)


def check_role(role: str | None) -> str | None:
    """`--role`: matched or one of the diagnostic roles (exit 2 naming them otherwise)."""
    if role is None or role in ROLES:
        return role
    raise ProbeError(f"--role {role!r}: expected {MATCHED} or a diagnostic role ({', '.join(DIAGNOSTIC_ROLES)})")


def quantizes(engine_args: dict) -> bool:
    """Engine options that fake-quantize the training side (the hf engine's weight/act/kv quantization)."""
    return any(str(engine_args.get(key) or "none").lower() not in ("none", "") for key in QUANT_OPTIONS)


def options_role(*, replay: str, repeats: int, sampling: str, engine_args: dict, old: str | None) -> str | None:
    """The diagnostic role a rescore's options imply; None for a plain pass (its role is then unset)."""
    if old is not None:
        return POLICY
    if replay != NO_REPLAY:
        return replay
    if repeats > 1:
        return REPEATS
    if sampling != RAW:
        return SAMPLING
    if quantizes(engine_args):
        return QUANT
    return None


def recorded_role(manifest, name: str) -> str | None:
    """The score set's role as its manifest records it; for a manifest written before roles, the diagnostic role
    its other fields imply (a new policy, a replay, a repeated pass, truncated sampling, quantization, a sweep
    variant's name), else None: a plain set."""
    if getattr(manifest, "kind", None) == ENGINE_PREFILL:  # the inference engine's own prefill, whatever --role said
        return ENGINE_PREFILL
    role = getattr(manifest, "role", None)
    if role is not None:
        return role
    if manifest.is_new_policy:
        return POLICY
    if (manifest.replay or NO_REPLAY) != NO_REPLAY:
        return manifest.replay
    if manifest.repeat_group:
        return REPEATS
    if (manifest.sampling or {}).get("logprobs_mode", RAW) != RAW:
        return SAMPLING
    if manifest.quantization:
        return QUANT
    if SWEEP_MARK in name:
        return SWEEP
    return None
