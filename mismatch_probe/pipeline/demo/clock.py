"""The demo's step clock: the wall time of each step (generate, each rescore, the policy passes, each report, the
sweep), printed at the demo's end and kept in summary.json, so a user sees where a run's time went. The steps of
the second process (beside.py), which ran at the same time as the first's, are kept apart: each process's steps
add up to at most the total."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.table import Table


@dataclass
class StepClock:
    """Wall seconds per step, in the order the steps ran; a step that fails is timed too (up to the failure)."""

    steps: list[tuple[str, float]] = field(default_factory=list)
    beside: list[tuple[str, float]] = field(default_factory=list)  # the second process's, run at the same time
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.steps.append((label, time.perf_counter() - start))

    def total(self) -> float:
        return time.perf_counter() - self.started

    def as_dict(self) -> dict:
        def rows(steps: list[tuple[str, float]]) -> list[dict]:
            return [{"step": label, "seconds": round(s, 2)} for label, s in steps]

        return {"steps": rows(self.steps), "beside": rows(self.beside), "total": round(self.total(), 2)}

    def table(self) -> Table:
        total = self.total()
        title = f"demo: wall time per step ({_clock(total)} in all)"
        if self.beside:
            title += "; the second process's steps ran beside the first's"
        table = Table(title=title)
        for name in ("process", "step", "wall", "share"):
            table.add_column(name, justify="left" if name == "step" else "right")
        for process, steps in (("1", self.steps), ("2", self.beside)):
            for label, seconds in steps:
                table.add_row(process, label, _clock(seconds), f"{seconds / total:.0%}" if total else "-")
        return table


def _clock(seconds: float) -> str:
    """`4.2 s` below a minute, else `3 min 04 s`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"
