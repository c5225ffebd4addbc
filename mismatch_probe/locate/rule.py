"""Which operation stands out, and the sentence that says so.

An operation stands out when its own error is above the float32 rounding floor of that operation and at
least MARGIN times the next largest own error of the same kind: relative-L2 rows (attention, mlp,
final_norm, logits) are compared with each other, router rows with each other; block rows are summaries and
take no part. The first standing-out operation in network order is the one located.

The floors: a float32 dot product of length K has a typical relative rounding error near u·√K, u = 2⁻²⁴ (its
unit roundoff); the floor is FLOOR_FACTOR·u·√K with K the longest dot product of the operation (the hidden
size, the attention width, the MLP's intermediate size). A router row needs more than one token whose expert
set differs: one flip can be a near tie that float32 rounding alone decides."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mismatch_probe.locate.measures import Row
from mismatch_probe.locate.ops import ATTENTION, BLOCK, FINAL_NORM, LOGITS, MLP, ROUTER
from mismatch_probe.report import numbers

U32 = 2.0**-24
FLOOR_FACTOR = 10.0
MARGIN = 10.0
L2_OPS = (ATTENTION, MLP, FINAL_NORM, LOGITS)


SCORES = "router_scores"  # a router's scores (logits), relative L2: compared with the relative-L2 rows


def floor(op: str, reduction: dict[str, int], tokens: int) -> float:
    if op == ROUTER:
        return 1.0 / tokens if tokens else 0.0  # more than one flipped token
    if op == SCORES:
        return FLOOR_FACTOR * U32 * math.sqrt(reduction.get(ROUTER, reduction[FINAL_NORM]))
    return FLOOR_FACTOR * U32 * math.sqrt(reduction[op])


@dataclass
class Verdict:
    located: Row | None
    next_own: float | None  # the next largest own error of the located row's kind
    largest: Row  # the largest own relative error among the finest rows
    bitwise: bool
    sentence: str
    floors: dict[str, float]
    by_scores: bool = False  # a router located by its scores' relative L2, not by its flips

    @property
    def margin(self) -> float | None:
        if self.located is None or not self.next_own:
            return None
        own = self.located.own_scores if self.by_scores else self.located.own
        return own / self.next_own


def _measures(row: Row) -> list[tuple[str, str, float]]:
    """(kind, floor key, own) of each measure a row takes part with: "l2" (relative L2) or "router" (flips)."""
    if row.op == ROUTER:
        flips = [("router", ROUTER, row.own)]
        return flips + ([("l2", SCORES, row.own_scores)] if row.own_scores is not None else [])
    return [("l2", row.op, row.own)] if row.op in L2_OPS else []


def judge(rows: list[Row], reduction: dict[str, int], tokens: int) -> Verdict:
    floors = {op: floor(op, reduction, tokens) for op in (ATTENTION, ROUTER, MLP, BLOCK, FINAL_NORM, LOGITS, SCORES)}
    bitwise = all(row.own == 0 and row.accumulated == 0 for row in rows)
    measured = [(row, *m) for row in rows for m in _measures(row)]
    largest = max((row for row in rows if row.op in L2_OPS), key=lambda row: row.own)
    located, next_own, by_scores = None, None, False
    for row, kind, key, own in measured:
        runner_up = max((o for r, k, _, o in measured if k == kind and r is not row), default=0.0)
        if own > floors[key] and own >= MARGIN * runner_up:
            located, next_own, by_scores = row, runner_up, key == SCORES
            break
    verdict = Verdict(
        located=located,
        next_own=next_own,
        largest=largest,
        bitwise=bitwise,
        sentence="",
        floors=floors,
        by_scores=by_scores,
    )
    verdict.sentence = sentence(verdict, rows)
    return verdict


def sentence(verdict: Verdict, rows: list[Row]) -> str:
    logits = rows[-1]
    tail = f"the logits end {numbers.value(logits.accumulated)} apart (relative L2)"
    if verdict.bitwise:
        return "the two configurations agree bitwise on these sequences: nothing to locate"
    row = verdict.located
    finest = [own for r in rows for _, _, own in _measures(r)]
    blocks = [r for r in rows if r.op == BLOCK and r.own > 0]
    if row is None and not any(finest) and blocks:
        big = max(blocks, key=lambda r: r.own)
        return (
            f"no attention, router or mlp operation has any own error, but {big.where} does "
            f"({numbers.value(big.own)}): the difference is in the layer outside those branches (its residual adds, "
            f"or norms after the branches); {tail}"
        )
    if row is None and not any(finest):
        return (
            "no operation has any own error: the difference enters before layer 0 (the embeddings, or what the "
            f"layers are given); {tail}"
        )
    if row is None:
        big = verdict.largest
        return (
            f"no single operation stands out: the error grows evenly; the largest own error is in {big.where} "
            f"({numbers.value(big.own)}, relative L2); {tail}"
        )
    if verdict.next_own:
        versus = f"{numbers.times(verdict.margin)} the next largest of its kind"
    else:
        versus = "no other operation of its kind has any own error"
    if verdict.by_scores:
        what = (
            f"its scores' (logits') own relative error {numbers.value(row.own_scores)}, with {row.own_flips} of "
            f"{row.tokens} tokens choosing other experts from a's input"
        )
    elif row.op == ROUTER:
        what = (
            f"{row.own_flips} of {row.tokens} tokens choose other experts from a's input ({numbers.percent(row.own)})"
        )
    else:
        what = f"own relative error {numbers.value(row.own)}"
    return f"the divergence starts in {row.where}: {what}, {versus}; {tail}"
