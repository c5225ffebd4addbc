"""The part of a key after `@` (SPEC section 5): the levels a family is computed at, with their defaults and the
parsers of the options that change them, and the fixed values of the families the user does not parameterise.

A level keeps the spelling the user gave (`--thresholds 2.50` writes `extreme_fraction@2.50`), so a key asked
for by name is found under that name; `threshold_label` is that spelling for a number given in code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mismatch_probe.errors import ProbeError

DEFAULT_THRESHOLDS = (1.5, 2, 5, 10)  # --thresholds: extreme_fraction@T
DEFAULT_TIS_CAPS = (2, 5)  # --tis-caps: the @C keys
DEFAULT_GEO_BOUNDS = (1.001, 1.01)  # --geo-bounds: the @T reject fractions
DEFAULT_PPO_BOUNDS = (("below", "0.8"), ("above", "1.2"), ("above", "1.27"))  # --ppo-bounds: the @B keys
PPO_SIDES = ("below", "above")
GAMMA_MIN = 0.8  # RSPO's default floor γ_min: router_shift_clip_fraction@0.8
DEFAULT_WORST = 20  # --worst: tokens listed per comparison
DEFAULT_MIN_RATIO = 1.5  # --drift-ratio: the ratio a change over steps must clear to be named a drift

# n_tokens@SPLIT, k3_kl@SPLIT: tokens whose expert sets agree in every MoE layer / differ in one
ROUTING_SPLITS = ("routing_same", "routing_diff")
# rs_*@MODE: verl's sequence-level rejection statistics (compute_rollout_rejection_mask), k1 = -safe,
# k2 = safe^2 / 2, k3 = exp(safe) - 1 - safe per token, summed, averaged or maximised over a sequence
MODES = (
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def threshold_label(t) -> str:
    """The key suffix of `extreme_fraction@T`: T as the user wrote it (2 -> "2", 1.5 -> "1.5")."""
    if isinstance(t, str):
        return t.strip()
    t = float(t)
    return str(int(t)) if t.is_integer() else repr(t)


def parse_levels(
    values, option: str, valid: Callable[[float], bool], requirement: str, example: str
) -> tuple[str, ...]:
    """Thresholds, caps or bounds as the user spelled them (the spelling is the key suffix)."""
    labels = []
    for value in values:
        label = threshold_label(value)
        try:
            level = float(label)
        except ValueError:
            raise ProbeError(f"{option}: {label!r} is not a number") from None
        if not math.isfinite(level) or not valid(level):
            raise ProbeError(f"{option}: {label} must be a finite number {requirement}")
        if label not in labels:
            labels.append(label)
    if not labels:
        raise ProbeError(f"{option}: expected at least one value, e.g. {example}")
    return tuple(labels)


def parse_caps(values) -> tuple[str, ...]:
    return parse_levels(values, "--tis-caps", lambda c: c > 0, "> 0, e.g. 2,5", "2,5")


def parse_bounds(values) -> tuple[str, ...]:
    return parse_levels(values, "--geo-bounds", lambda b: b > 1, "> 1, e.g. 1.001,1.01", "1.001,1.01")


def parse_ppo_bounds(values) -> tuple[tuple[str, str], ...]:
    """`--ppo-bounds below@0.8,above@1.2`: each a side and a bound B > 0 as the user spelled it (the key's suffix)."""
    bounds = []
    for value in values:
        text = "@".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value).strip()
        side, at, bound = text.partition("@")
        if not at or side not in PPO_SIDES:
            raise ProbeError(f"--ppo-bounds: {text!r}, expected below@B or above@B, e.g. below@0.8,above@1.2")
        (label,) = parse_levels([bound], "--ppo-bounds", lambda b: b > 0, "> 0, e.g. above@1.2", "below@0.8,above@1.2")
        if (side, label) not in bounds:
            bounds.append((side, label))
    if not bounds:
        raise ProbeError("--ppo-bounds: expected at least one bound, e.g. below@0.8,above@1.2")
    return tuple(bounds)


def ppo_bound_labels(bounds) -> list[str]:
    """The bounds as --ppo-bounds spells them: `below@0.8`."""
    return [f"{side}@{bound}" for side, bound in bounds]


def parse_worst(value) -> int:
    """--worst N: how many tokens to list per comparison; 0 lists none."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ProbeError(f"--worst: {value!r}, expected an integer >= 0")
    return int(value)
