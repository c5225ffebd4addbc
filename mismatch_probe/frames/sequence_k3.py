"""k3 of one comparison of a run and its bootstrap resamples, streamed outside the report's pass.

A sweep's rollout and both variants are sibling runs (rundir/sweep.py): their tokens are not RUN's, so the
report's pass over RUN does not read them. Their k3 against their own rollout is read here, row group by
row group, keys and log-probs only, over the rows the report compares (`PairFrame.compared`), and reduced per
chunk to each sequence's k3 sum and token count. A sequence cut between chunks gives a piece in each; its
Poisson weight depends only on (seed, sample id, resample), so the pieces' weighted sums add up to the
sequence's, and no sequence needs to be held open across chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from mismatch_probe.frames.align import aligned_chunks
from mismatch_probe.frames.bootstrap import RESAMPLES, SEED, poisson_weights
from mismatch_probe.frames.pair_frame import ChunkRows, PairFrame, ResponseIndex
from mismatch_probe.frames.sequence_sums import segment_sums
from mismatch_probe.rundir.layout import Run


def sequence_k3(run: Run, reference: str, candidate: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per chunk of aligned rows: the sample ids [m] of its sequences and [2, m] their k3 sums and compared
    tokens in the chunk."""
    shape = run.manifest().routing
    tracker = ResponseIndex()
    for chunks in aligned_chunks(run, [reference, candidate], shape, logprobs_only=True):
        rows = ChunkRows.of(chunks[reference], tracker, response_scope=False)
        frame = PairFrame(rows=rows, ref=chunks[reference], cand=chunks[candidate])
        m = len(rows.segment_ids)
        sums = segment_sums(frame.k3[None, :], frame.segment, m)
        yield rows.segment_ids, np.vstack([sums, np.bincount(frame.segment, minlength=m)[None, :]])


@dataclass(frozen=True, kw_only=True)
class ResampledK3:
    """A k3 (token-weighted mean over the compared tokens) and its value in each bootstrap resample."""

    n_tokens: int
    k3: float | None
    resampled: np.ndarray  # [resamples]


def resampled_k3(pieces: Iterable[tuple[np.ndarray, np.ndarray]], seed: int = SEED, resamples: int = RESAMPLES):
    """ResampledK3 over (ids, [2, m] k3 sums and token counts) pieces, with Poisson weights of `seed`."""
    totals, weighted = np.zeros(2), np.zeros((2, resamples))
    for ids, sums in pieces:
        if len(ids):
            totals += sums.sum(axis=1)
            weighted += sums @ poisson_weights(ids, seed, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        resampled = weighted[0] / weighted[1]
    k3 = float(totals[0] / totals[1]) if totals[1] else None
    return ResampledK3(n_tokens=int(totals[1]), k3=k3, resampled=resampled)
