"""RSPO's router shift and how often a replay overrides the natural routes, per token, from the router row of
the forward that scored it (row p − 1 for the token at position p).

Router shift, per row and MoE layer ℓ: d_ℓ = (1/K) Σ_k |log r_new(e_k) − log r_old(e_k)| over the old pass's K
experts e_k, with log r the log-softmax over all experts (the old set's `expert_logprobs`, the new pass's
`expert_logprobs_at_old`); Δ = mean of d_ℓ over layers; γ = exp(−Δ). RSPO rescales the IS ratio by
max(γ, γ_min) before clipping and logs the fraction with γ < γ_min.

Override: the fraction of (token, layer) routes whose expert set in the new pass differs from the natural
new pass N's own (0 for N itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mismatch_probe.report.keys.families import ROUTER_SHIFT_CLIP_FRACTION, RSPO_RATIO_FRACTION
from mismatch_probe.report.keys.levels import DEFAULT_PPO_BOUNDS, GAMMA_MIN
from mismatch_probe.report.policy.sides import PolicySides
from mismatch_probe.report.policy.tokens import PolicyTokens
from mismatch_probe.report.policy.totals import Totals

SHIFT_ROWS = "router_shift"  # PairFrame.before's name of shift_rows


def shift_rows(frame, sides: PolicySides) -> tuple[np.ndarray, ...]:
    """Per row: Δ and whether it is known, the layers overridden and whether that is known (zeros, unknown,
    where a side lacks what it needs)."""
    tokens = PolicyTokens(frame=frame, sides=sides)
    n = len(frame.rows.sample_id)
    delta = _row_delta(tokens) or (np.zeros(n), np.zeros(n, dtype=bool))
    overrides = _row_overrides(tokens) or (np.zeros(n), np.zeros(n, dtype=bool))
    return (*delta, *overrides)


def _row_delta(tokens: PolicyTokens) -> tuple[np.ndarray, np.ndarray] | None:
    """Per row, Δ and whether both passes hold the router log-probs it needs; None when a side has none."""
    old, new = tokens.frame.ref.expert_logprobs, tokens.frame.cand.expert_logprobs_at_old
    if old is None or new is None:
        return None
    delta = np.abs(new[0].astype(np.float64) - old[0]).mean(axis=(1, 2))
    return delta, old[1] & new[1]


def _row_overrides(tokens: PolicyTokens) -> tuple[np.ndarray, np.ndarray] | None:
    """Per row, the MoE layers whose expert set differs from N's, and whether both passes have routing there."""
    natural, new = tokens.natural, tokens.frame.cand
    if natural is None or natural.experts is None or new.experts is None:
        return None
    differs = (np.sort(new.experts, axis=-1) != np.sort(natural.experts, axis=-1)).any(axis=-1)
    return differs.sum(axis=1).astype(np.float64), natural.experts_valid & new.experts_valid


@dataclass
class RouterShift:
    num_layers: int
    ppo_bounds: tuple[tuple[str, str], ...] = DEFAULT_PPO_BOUNDS
    clip_levels: tuple = (GAMMA_MIN,)
    gamma_min: float = GAMMA_MIN
    shift: Totals = field(default=None)
    overrides: Totals = field(default=None)

    def __post_init__(self):
        if self.shift is None:
            columns = ["n", "delta", "gamma"] + [f"clip{i}" for i in range(len(self.clip_levels))]
            columns += [f"rspo{i}" for i in range(len(self.ppo_bounds))]
            self.shift = Totals(columns=tuple(columns))
            self.overrides = Totals(columns=("routes", "overridden"))

    def update(self, tokens: PolicyTokens) -> None:
        rows = tokens.frame.rows
        has, (row_delta, delta_ok, row_over, over_ok) = tokens.frame.before[SHIFT_ROWS]
        at = tokens.index
        shift_ok = (has & delta_ok)[at]
        gamma = np.exp(-row_delta[at])
        corrected = tokens.s + np.log(np.maximum(gamma, self.gamma_min))
        values = {"n": shift_ok, "delta": np.where(shift_ok, row_delta[at], 0.0), "gamma": np.where(shift_ok, gamma, 0)}
        for i, level in enumerate(self.clip_levels):
            values[f"clip{i}"] = shift_ok & (gamma < float(level))
        for i, (side, bound) in enumerate(self.ppo_bounds):
            beyond = corrected < np.log(float(bound)) if side == "below" else corrected > np.log(float(bound))
            values[f"rspo{i}"] = shift_ok & beyond
        self.shift.add(rows, tokens.segment, values)
        over = (has & over_ok)[at]
        routes = {"routes": over * float(self.num_layers), "overridden": np.where(over, row_over[at], 0.0)}
        self.overrides.add(rows, tokens.segment, routes)

    def merge(self, other: RouterShift) -> None:
        self.shift.merge(other.shift)
        self.overrides.merge(other.overrides)

    def finish(self) -> dict:
        self.shift.close()
        self.overrides.close()

        def mean(col: str):
            return lambda t: t[col] / t["n"]

        formulas = {"router_shift_delta_mean": mean("delta"), "router_shift_ratio_mean": mean("gamma")}
        formulas |= {ROUTER_SHIFT_CLIP_FRACTION.at(level): mean(f"clip{i}") for i, level in enumerate(self.clip_levels)}
        formulas |= {RSPO_RATIO_FRACTION[side].at(b): mean(f"rspo{i}") for i, (side, b) in enumerate(self.ppo_bounds)}
        shift = self.shift.metrics(formulas)
        override = self.overrides.metrics({"replay_override_rate": lambda t: t["overridden"] / t["routes"]})
        return shift | override
