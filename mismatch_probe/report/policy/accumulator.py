"""A policy comparison's own statistics, fed the same frames as every other accumulator of the comparison
(reference = the old pass, candidate = the new pass), with the rollout and N read as extra sides."""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch_probe.frames.pair_frame import PairFrame
from mismatch_probe.report.keys.levels import DEFAULT_PPO_BOUNDS, DEFAULT_TIS_CAPS, GAMMA_MIN
from mismatch_probe.report.policy.decomposition import Decomposition
from mismatch_probe.report.policy.kind import POLICY
from mismatch_probe.report.policy.router_shift import RouterShift
from mismatch_probe.report.policy.sides import PolicySides
from mismatch_probe.report.policy.tokens import PolicyTokens


@dataclass
class PolicyStats:
    sides: PolicySides
    num_layers: int
    tis_caps: tuple = DEFAULT_TIS_CAPS
    ppo_bounds: tuple = DEFAULT_PPO_BOUNDS
    clip_levels: tuple = (GAMMA_MIN,)
    decomposition: Decomposition = field(default=None)
    shift: RouterShift | None = None

    def __post_init__(self):
        if self.decomposition is None:
            self.decomposition = Decomposition(ppo_bounds=self.ppo_bounds, tis_caps=self.tis_caps)
            if self.num_layers:
                self.shift = RouterShift(
                    num_layers=self.num_layers, ppo_bounds=self.ppo_bounds, clip_levels=self.clip_levels
                )

    def update(self, frame: PairFrame) -> None:
        tokens = PolicyTokens(frame=frame, sides=self.sides)
        self.decomposition.update(tokens)
        if self.shift is not None:
            self.shift.update(tokens)

    def merge(self, other: PolicyStats) -> None:
        self.decomposition.merge(other.decomposition)
        if self.shift is not None:
            self.shift.merge(other.shift)

    def finish(self) -> dict:
        metrics = self.decomposition.finish(has_natural=self.sides.natural is not None)
        if self.shift is not None:
            metrics |= self.shift.finish()
        return {
            "metrics": metrics,
            "kind": POLICY,
            "replay": self.sides.replay,
            "policy_step": self.sides.step,
            "natural": self.sides.natural,
        }
