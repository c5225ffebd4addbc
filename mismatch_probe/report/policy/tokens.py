"""The tokens a policy comparison uses and their log-probs on each side: response tokens with a finite
log-prob on the rollout μ, the old pass, the new pass and (where there is one) the natural new pass N."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from mismatch_probe.frames.align import SideChunk
from mismatch_probe.frames.pair_frame import PairFrame
from mismatch_probe.report.policy.sides import PolicySides


def _ok(chunk: SideChunk) -> np.ndarray:
    return chunk.logprob_valid & np.isfinite(chunk.logprob)


@dataclass
class PolicyTokens:
    frame: PairFrame  # reference = old, candidate = new
    sides: PolicySides

    @property
    def rollout(self) -> SideChunk:
        return self.frame.extra[self.sides.rollout]

    @property
    def natural(self) -> SideChunk | None:
        if self.sides.natural is None:
            return None
        return self.frame.cand if self.sides.natural == self.sides.candidate else self.frame.extra[self.sides.natural]

    @cached_property
    def use(self) -> np.ndarray:
        use = self.frame.use & _ok(self.rollout)
        return use & _ok(self.natural) if self.natural is not None else use

    @cached_property
    def index(self) -> np.ndarray:
        return np.flatnonzero(self.use)

    def logprob(self, chunk: SideChunk) -> np.ndarray:
        return chunk.logprob[self.index].astype(np.float64)

    @cached_property
    def a(self) -> np.ndarray:
        """Training–inference factor ℓ_old − μ."""
        return self.logprob(self.frame.ref) - self.logprob(self.rollout)

    @cached_property
    def s(self) -> np.ndarray:
        """Staleness factor ℓ_new − ℓ_old."""
        return self.logprob(self.frame.cand) - self.logprob(self.frame.ref)

    @cached_property
    def b(self) -> np.ndarray | None:
        """Replay bias ℓ_new − ℓ_new^N; None without a natural pass."""
        if self.natural is None:
            return None
        return self.logprob(self.frame.cand) - self.logprob(self.natural)

    @cached_property
    def segment(self) -> np.ndarray:
        return self.frame.rows.segment[self.index]
