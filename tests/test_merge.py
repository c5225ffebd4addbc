"""Accumulators merge exactly: a run's chunks split into ranges, each range fed to its own comparisons, the
ranges merged, give the metrics.json of one pass (counts exactly, floats to 1e-12 relative, the same
bootstrap intervals and worst tokens), whatever the cut points and the merge order."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from frames import assert_close

from mismatch_probe.frames.sequence_sums import OpenSequences, segment_maxima, segment_sums
from mismatch_probe.report.accumulators.base import Accumulator
from mismatch_probe.report.build import build_report
from mismatch_probe.report.keys.request import ReportRequest
from mismatch_probe.report.stream.scan import chunk_frames, new_comparisons
from mismatch_probe.report.stream.token_context import attach_context
from mismatch_probe.report.verdict.attribution import attribute, error_split_plan
from mismatch_probe.rundir import parts as table_io
from mismatch_probe.rundir.layout import Run
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

SPEC = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=12,
    n_samples=40,
    prompt_len=(2, 6),
    response_len=(3, 40),
    seed=9,
    router_margin=True,
    samples_per_part=15,
    score_sets=(
        ScoreSetSpec("bf16", logprob_sigma=0.3, route_fraction=0.2, shuffle_order=True, nonfinite_fraction=0.05),
        ScoreSetSpec("fp32", logprob_sigma=0.01, route_fraction=0.01, dtype="fp32"),
        ScoreSetSpec("rep1", repeat_group="rep", pass_index=1),
        ScoreSetSpec("rep2", repeat_group="rep", pass_index=2),
    ),
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = write_synthetic_run(tmp_path_factory.mktemp("merge") / "run", SPEC)
    for path in sorted((root / "scores" / "bf16").glob("part-*.parquet")):  # row groups that cut sequences
        pq.write_table(pq.read_table(path), path, row_group_size=29)
    return Run(root)


@pytest.fixture(scope="module")
def single(run):
    return build_report(run.root, render=False).metrics


def _chunks(run: Run, monkeypatch) -> list:
    """The frames of every chunk, in order (one pass, as the report reads the run)."""
    monkeypatch.setattr(table_io, "BATCH_ROWS", 16)  # many chunks, most sequences cut between them
    pairs = run.default_pairs()
    template = new_comparisons(run, pairs, ReportRequest(), fp32_sides=error_split_plan(run, pairs))
    return list(chunk_frames(run, template, "all"))


def _merged(run: Run, chunks: list, cuts: list[int], order: list[int]) -> dict:
    """metrics.json's comparisons and attribution from the chunks cut at `cuts` into ranges merged in `order`."""
    pairs = run.default_pairs()
    bounds = [0, *cuts, len(chunks)]
    ranges = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        comparisons = new_comparisons(run, pairs, ReportRequest(), fp32_sides=error_split_plan(run, pairs))
        for frames in chunks[a:b]:
            for comp, frame in zip(comparisons, frames):
                comp.update(frame)
        ranges.append(comparisons)
    merged = ranges[order[0]]
    assert all(isinstance(acc, Accumulator) for comp in merged for acc in comp.accumulators())
    for i in order[1:]:
        for comp, other in zip(merged, ranges[i]):
            comp.merge(other)
    for comp in merged:
        comp.finish()
    attach_context(run, run.manifest().model, [comp.worst for comp in merged])
    comparisons = [comp.to_json("all") for comp in merged]
    return {"comparisons": comparisons, "attribution": attribute(run, merged, comparisons)}


def _inside_one_sequence(chunks: list) -> int:
    """A chunk whose rows all belong to the sequence that the chunks before and after it also hold."""
    ids = [frames[0].rows.segment_ids for frames in chunks]
    return next(i for i in range(1, len(ids) - 1) if len(ids[i]) == 1 and ids[i - 1][-1] == ids[i][0] == ids[i + 1][0])


@pytest.mark.parametrize("split", ["halves", "halves reversed", "one chunk inside a sequence", "empty ranges"])
def test_merged_ranges_give_the_single_pass(run, single, monkeypatch, split):
    chunks = _chunks(run, monkeypatch)
    n = len(chunks)
    assert n > 50
    k = _inside_one_sequence(chunks)
    cuts, order = {
        "halves": ([n // 2], [0, 1]),
        "halves reversed": ([n // 2], [1, 0]),
        "one chunk inside a sequence": ([k, k + 1, n - 3], [1, 3, 0, 2]),
        "empty ranges": ([0, n], [0, 1, 2]),
    }[split]
    merged = _merged(run, chunks, cuts, order)
    assert_close(merged["comparisons"], single["comparisons"])
    assert_close(merged["attribution"], single["attribution"])
    error_split = single["attribution"]["numerics"]
    assert error_split and error_split[0]["n_tokens"] > 0  # the fp32 split is merged too
    assert all(c["worst_tokens"] and c["routing_forensics"]["margin_flip"] for c in single["comparisons"])


def test_segment_sums_against_bincount():
    rng = np.random.default_rng(2)
    for m in (1, 3, 8):
        for n in (0, 1, 5, 60):
            segment = np.sort(rng.choice(np.arange(1, m - 1) if m > 2 else np.arange(m), size=n))  # empty first/last
            values = rng.normal(size=(3, n))
            want = np.array([np.bincount(segment, weights=v, minlength=m) for v in values]).reshape(3, m)
            np.testing.assert_allclose(segment_sums(values, segment, m), want, rtol=1e-14, atol=1e-15)


def test_segment_maxima_against_a_loop():
    rng = np.random.default_rng(3)
    segment = np.array([0, 0, 2, 2, 2, 4])
    values = rng.normal(size=(2, len(segment)))
    got = segment_maxima(values, segment, 6)
    for j in range(6):
        mine = values[:, segment == j]
        assert got[:, j].tolist() == (mine.max(axis=1).tolist() if mine.size else [-np.inf, -np.inf])


def test_open_sequences_carry_maxima_across_ranges():
    first, second = OpenSequences(combine=np.maximum), OpenSequences(combine=np.maximum)
    first.add(np.array([5, 7]), np.array([[1.0, 3.0]]))
    second.add(np.array([7, 8]), np.array([[2.0, 9.0]]))
    second.merge(first)
    ids, maxima = second.close(1)
    assert ids.tolist() == [5, 7, 8] and maxima.tolist() == [[1.0, 3.0, 9.0]]


def test_open_sequences_hand_out_each_sequence_once_whole():
    """Sequence 7 straddles the two ranges; 5 begins the first and 9 ends the second: all stay open until close."""
    first, second = OpenSequences(), OpenSequences()
    done = [first.add(np.array([5, 6, 7]), np.array([[1.0, 2.0, 3.0]]))]
    done.append(first.add(np.array([7]), np.array([[4.0]])))
    done.append(second.add(np.array([7, 8]), np.array([[10.0, 20.0]])))
    done.append(second.add(np.array([8, 9]), np.array([[30.0, 40.0]])))
    assert [ids.tolist() for ids, _ in done] == [[6], [], [], [8]]
    assert done[3][1].tolist() == [[50.0]]
    second.merge(first)
    ids, sums = second.close(1)
    assert ids.tolist() == [5, 7, 9] and sums.tolist() == [[1.0, 17.0, 40.0]]
