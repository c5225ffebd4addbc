"""The cost `probe sweep` compares: a score set's tokens per second, timed inside the engine's forwards and
without the warm-up of its first micro-batch."""

from __future__ import annotations

import itertools

from mismatch_probe.engines.base import ScoreOptions
from mismatch_probe.pipeline import rescore
from mismatch_probe.pipeline.rescore import ForwardSpeed


class Request:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class CountingEngine:
    def score(self, batch, options):
        return [len(r) for r in batch]


def test_speed_leaves_out_the_first_micro_batch(monkeypatch):
    # each forward reads the clock twice; the first forward takes 10 s (warm-up), the next two 1 s and 3 s
    ticks = itertools.chain([0.0, 10.0, 10.0, 11.0, 11.0, 14.0])
    monkeypatch.setattr(rescore.time, "perf_counter", lambda: next(ticks))
    speed = ForwardSpeed()
    batches = [[Request(5), Request(5)], [Request(30)], [Request(10), Request(10)]]
    records = speed.score(CountingEngine(), batches, ScoreOptions(temperature=1.0))
    assert records == [5, 5, 30, 10, 10]
    assert speed.timed == [(10, 10.0), (30, 1.0), (20, 3.0)]
    assert speed.tokens_per_second == (30 + 20) / (1.0 + 3.0)


def test_speed_of_one_micro_batch_is_its_own_and_of_none_is_unknown():
    speed = ForwardSpeed()
    assert speed.tokens_per_second is None
    speed.timed = [(12, 4.0)]
    assert speed.tokens_per_second == 3.0
