"""The doctor's accumulators merge exactly: two ranges of chunks, merged, give the single pass's sums,
including the shifted pairs that straddle the boundary (a split report must find what one pass finds)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mismatch_probe.doctor.state import Doctor
from mismatch_probe.doctor.stats.transport import RunFit
from mismatch_probe.frames.align import SideChunk, aligned_chunks
from mismatch_probe.frames.pair_frame import FrameBuilder
from mismatch_probe.rundir.layout import Run
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

CUT = 37  # rows per chunk: boundaries fall inside samples and inside responses
SPEC = SyntheticSpec(
    n_samples=40,
    score_sets=(
        ScoreSetSpec(name="a", repeat_group="a", pass_index=1),
        ScoreSetSpec(name="b", repeat_group="a", pass_index=2),
    ),
)


def _cut(chunk: SideChunk, start: int) -> SideChunk:
    """Rows start..start+CUT of a side's chunk: every array field sliced, tuples of arrays too."""
    values = {}
    for f in dataclasses.fields(chunk):
        value = getattr(chunk, f.name)
        if isinstance(value, np.ndarray):
            value = value[start : start + CUT]
        elif isinstance(value, tuple):
            value = tuple(v[start : start + CUT] for v in value)
        values[f.name] = value
    return SideChunk(**values)


def _frames(run: Run, doctor: Doctor) -> list:
    shape = run.manifest().routing
    builder = FrameBuilder(shape=shape)
    keys = [(ref, cand, None) for ref, cand in doctor.pairs]
    (whole,) = list(aligned_chunks(run, doctor.sides, shape))  # one part: one chunk, cut here
    n = len(next(iter(whole.values())).sample_id)
    return [
        builder.frames({side: _cut(chunk, start) for side, chunk in whole.items()}, keys) for start in range(0, n, CUT)
    ]


def _one_pass_and_two_ranges(tmp_path, split: int) -> tuple[Doctor, Doctor]:
    """The doctor of a synthetic run in one pass, and that of its frames in two ranges (cut after `split`
    frames), merged."""
    run = Run(write_synthetic_run(tmp_path / "run", SPEC))
    pairs = run.default_pairs()
    whole = Doctor(run, pairs)
    frames = _frames(run, whole)
    assert len(frames) > split
    for chunk in frames:
        whole.update(chunk)
    first, second = Doctor(run, pairs), Doctor(run, pairs)
    for chunk in frames[:split]:
        first.update(chunk)
    for chunk in frames[split:]:
        second.update(chunk)
    second.merge(first)  # the later range takes the earlier one: order must not matter
    return whole, second


@pytest.mark.parametrize("split", [1, 5, 11])
def test_two_ranges_merge_into_the_single_pass(tmp_path, split):
    whole, second = _one_pass_and_two_ranges(tmp_path, split)
    for merged, single in zip(second.pair_stats, whole.pair_stats):
        assert merged.finish() == pytest.approx(single.finish(), rel=1e-12)
        assert merged.s["n_later"] == single.s["n_later"] > 0
    for side in whole.side_stats:
        assert second.side_stats[side].finish() == whole.side_stats[side].finish()
    assert [f.to_json() for f in second.findings()] == [f.to_json() for f in whole.findings()]


def test_routed_alike_counts_sets_whatever_the_order_of_ids():
    """The bitmask count against a naive one (sorted ids compared per token), with shuffled and changed ids."""
    from mismatch_probe.doctor.stats.pair_stats import _tokens_routed_alike

    rng = np.random.default_rng(3)
    for experts, dtype in ((60, np.uint8), (200, np.uint8), (300, np.uint16)):
        x = np.stack([rng.permutation(experts)[:4] for _ in range(500 * 3)]).reshape(500, 3, 4).astype(dtype)
        y = rng.permuted(x, axis=-1)  # same sets, other order
        change = rng.random((500, 3)) < 0.1
        y[change, 0] = (y[change, 0].astype(np.int64) + 1 + rng.integers(0, experts - 1, change.sum())) % experts
        naive = int(np.sum([np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1)) for a, b in zip(x, y)]))
        assert _tokens_routed_alike(x, y) == naive
        assert 0 < naive < 500


def test_routed_alike_pairs_count_like_the_gathered_rows():
    """Pairs of rows (i, j) of x and y compared in place count what the naive per-pair comparison counts,
    with pairs alike in the first layer only, alike everywhere, and apart from the first layer."""
    from mismatch_probe.doctor.stats.pair_stats import _pairs_routed_alike

    rng = np.random.default_rng(4)
    x = np.stack([rng.permutation(40)[:4] for _ in range(400 * 5)]).reshape(400, 5, 4).astype(np.uint8)
    y = rng.permuted(x, axis=-1)
    y[::3, 2] = np.roll(y[::3, 2], 1, axis=0)  # every third row differs from layer 2 on only
    i = rng.integers(0, 400, 300)
    j = np.where(rng.random(300) < 0.5, i, rng.integers(0, 400, 300))  # half the pairs are the same row
    naive = sum(np.array_equal(np.sort(x[a], axis=-1), np.sort(y[b], axis=-1)) for a, b in zip(i, j))
    assert _pairs_routed_alike(x, i, y, j) == naive
    assert 0 < naive < 300
    assert _pairs_routed_alike(x, i[:0], y, j[:0]) == 0


@pytest.mark.parametrize("split", [1, 5, 11])
def test_second_round_accumulators_merge_into_the_single_pass(tmp_path, split):
    """Routes per layer and per side, |delta| per position, runs of equal values and sample digests: two
    ranges merged give the single pass's sums."""
    whole, second = _one_pass_and_two_ranges(tmp_path, split)
    for merged, single in zip(second.layer_diffs, whole.layer_diffs, strict=True):
        assert merged.finish() == single.finish() and single.finish()["rows"] > 0
    for merged, single in zip(second.positions, whole.positions, strict=True):
        np.testing.assert_allclose(merged.finish()["position_sums"], single.finish()["position_sums"], rtol=1e-12)
    for merged, single in zip(second.run_fits, whole.run_fits, strict=True):
        for a, b in zip(merged, single, strict=True):
            assert a.finish() == pytest.approx(b.finish(), rel=1e-12)
    for side, stats in whole.route_stats.items():
        assert second.route_stats[side].finish(SPEC.top_k) == stats.finish(SPEC.top_k)
    assert second.digests.finish() == whole.digests.finish()


class _Frame:
    """The fields RunFit reads, over rows that are all compared."""

    def __init__(self, sample, position, ref, cand):
        self.compared = np.arange(len(sample))
        self.rows = dataclasses.make_dataclass("Rows", ["sample_id", "position"])(sample, position)
        side = dataclasses.make_dataclass("Side", ["logprob"])
        self.ref, self.cand = side(ref), side(cand)
        self.delta = cand.astype(np.float64) - ref.astype(np.float64)


def _naive_runs(sample, ref, cand) -> dict:
    """Run by run, in a plain loop: runs of equal reference values within a sample."""
    out = dict.fromkeys(("fit", "stored", "tokens", "flat_tokens", "flat_runs"), 0.0)
    i = 0
    while i < len(sample):
        j = i
        while j + 1 < len(sample) and sample[j + 1] == sample[i] and ref[j + 1] == ref[i]:
            j += 1
        delta = [float(ref[t]) - float(cand[t]) for t in range(i, j + 1)]
        out["fit"] += abs(sum(delta))
        out["stored"] += sum(abs(d) for d in delta)
        out["tokens"] += j + 1 - i
        if j > i:
            out["flat_tokens"] += j + 1 - i
            out["flat_runs"] += 1
        i = j + 1
    return out


@pytest.mark.parametrize("cuts", [[5], [3, 11, 12, 29], [1, 2, 3, 4, 40]])
def test_run_fit_counts_each_run_once_across_chunks_and_ranges(cuts):
    """Runs of equal values (chunk totals spread) straddling chunk and range boundaries, against a loop."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 7, 20)
    ref = np.repeat(rng.normal(-1, 0.5, 20), lengths).astype(np.float32)
    cand = (ref + rng.normal(0, 0.3, len(ref))).astype(np.float32)
    sample = np.repeat(np.arange(4), [len(ref) // 4] * 3 + [len(ref) - 3 * (len(ref) // 4)]).astype(np.uint32)
    position = np.concatenate([np.arange(n) for n in np.bincount(sample)]).astype(np.uint32)
    bounds = [0, *cuts, len(ref)]
    frames = [_Frame(sample[a:b], position[a:b], ref[a:b], cand[a:b]) for a, b in zip(bounds, bounds[1:])]
    expected = _naive_runs(sample, ref, cand)
    assert expected["flat_runs"] > 5
    for split in range(len(frames) + 1):
        early, late = RunFit("ref"), RunFit("ref")
        for frame in frames[:split]:
            early.update(frame)
        for frame in frames[split:]:
            late.update(frame)
        late.merge(early)
        assert late.finish() == pytest.approx(expected, rel=1e-9)
