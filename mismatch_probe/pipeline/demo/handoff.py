"""What the demo's two processes (beside.py) hand each other: the MoE rollout, written by the first and scored by
the second too, and the second's MoE passes, which the first's MoE report reads. Each hand-off is a marker file in
the folder both processes share, written once its step has ended; the other process waits for it, and stops
waiting with an error if the process that should write it has ended first."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import EngineFailure

MOE_ROLLOUT = "moe-rollout.ready"  # the first process wrote the MoE model's rollout
MOE_PASSES = "moe-passes.ready"  # the second process wrote its MoE score sets
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Handoff:
    folder: Path

    def say(self, what: str) -> None:
        (self.folder / what).touch()

    def said(self, what: str) -> bool:
        return (self.folder / what).exists()

    def wait(self, what: str, writer_alive: Callable[[], bool], writer: str) -> None:
        """Returns once `what` is said; EngineFailure if `writer` ended without saying it."""
        while not self.said(what):
            if not writer_alive():
                if self.said(what):  # said just before it ended
                    return
                raise EngineFailure(f"{writer} ended before {what.removesuffix('.ready')} was written")
            time.sleep(POLL_SECONDS)
