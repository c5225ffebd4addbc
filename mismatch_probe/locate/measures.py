"""The two measures, summed over batches: relative L2 ‖b − a‖ / ‖a‖ (sums of squares in float64, so batches add
up), and for routers the share of tokens whose chosen expert set differs (counts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mismatch_probe.locate.ops import BLOCK, FINAL_NORM, LOGITS, ROUTER
from mismatch_probe.locate.side import Key, Record
from mismatch_probe.report import numbers

OWN, ACCUMULATED = "own", "accumulated"


@dataclass
class Row:
    layer: int | None
    op: str
    own: float
    accumulated: float
    tokens: int
    own_flips: int | None = None  # routers: tokens whose expert set differs
    accumulated_flips: int | None = None
    own_scores: float | None = None  # routers: relative L2 of the router's scores (logits); None across engines
    accumulated_scores: float | None = None

    @property
    def where(self) -> str:
        if self.layer is None:
            return "the final norm" if self.op == FINAL_NORM else "the logits"
        return f"layer {self.layer}'s {self.op}"

    def cell(self, which: str) -> str:
        """`which` ("own" or "accumulated") as the table shows it: routers as flips, and their scores' relative L2."""
        value = getattr(self, which)
        if self.op != ROUTER:
            return numbers.value(value)
        text = f"{numbers.percent(value)} ({getattr(self, which + '_flips')}/{self.tokens})"
        scores = getattr(self, which + "_scores")
        return text if scores is None else f"{text}; scores {numbers.value(scores)}"

    def to_json(self) -> dict:
        out = {"layer": self.layer, "op": self.op, "own": self.own, "accumulated": self.accumulated}
        if self.op == ROUTER:
            out |= {"own_flips": self.own_flips, "accumulated_flips": self.accumulated_flips, "tokens": self.tokens}
            out |= {"own_scores": self.own_scores, "accumulated_scores": self.accumulated_scores}
        return out


def _share(count: int, tokens: int) -> float:
    return count / tokens if tokens else 0.0


class Tally:
    def __init__(self):
        self.squares: dict[tuple[Key, str], list[float]] = {}  # -> [sum (b - a)², sum a²]
        self.flips: dict[tuple[int, str], list[int]] = {}  # -> [tokens whose sets differ, tokens]
        self.order: list[Key] = []
        self.tokens = 0

    def _key(self, key: Key) -> None:
        if key not in self.order:
            self.order.append(key)

    def add(self, a: Record, b: Record, own: Record) -> None:
        """One batch: a's record, b's, and b's operations on a's inputs."""
        self.tokens += len(a.outputs[(None, LOGITS)])
        for key, ref in a.outputs.items():
            self._key(key)
            for measure, other in ((ACCUMULATED, b), (OWN, own)):
                self._squares(key, measure, ref, other.outputs[key])
        for layer, chosen in a.chosen.items():
            self._key((layer, ROUTER))
            for measure, other in ((ACCUMULATED, b), (OWN, own)):
                self._flips(layer, measure, chosen, other.chosen[layer])
        for layer, scores in a.scores.items():  # hf sides only: megatron's router gives probabilities, not logits
            if layer in b.scores and layer in own.scores:
                for measure, other in ((ACCUMULATED, b), (OWN, own)):
                    self._squares((layer, ROUTER), measure, scores, other.scores[layer])

    def _squares(self, key: Key, measure: str, ref: torch.Tensor, value: torch.Tensor) -> None:
        ref = ref.detach().to("cpu", torch.float64)
        diff = value.detach().to("cpu", torch.float64) - ref
        sums = self.squares.setdefault((key, measure), [0.0, 0.0])
        sums[0] += float((diff * diff).sum())
        sums[1] += float((ref * ref).sum())

    def _flips(self, layer: int, measure: str, ref: torch.Tensor, value: torch.Tensor) -> None:
        ref, value = ref.detach().cpu().sort(-1).values, value.detach().cpu().sort(-1).values
        counts = self.flips.setdefault((layer, measure), [0, 0])
        counts[0] += int((ref != value).any(-1).sum())
        counts[1] += len(ref)

    def _relative(self, key: Key, measure: str) -> float:
        diff, ref = self.squares[(key, measure)]
        if ref == 0:
            return 0.0 if diff == 0 else float("inf")
        return (diff / ref) ** 0.5

    def rows(self) -> list[Row]:
        """Per layer attention, router, mlp, block; then final_norm and logits."""
        rank = {op: n for n, op in enumerate(("attention", ROUTER, "mlp", BLOCK))}
        layered = sorted((k for k in self.order if k[0] is not None), key=lambda k: (k[0], rank[k[1]]))
        keys = layered + [(None, FINAL_NORM), (None, LOGITS)]
        out = []
        for layer, op in keys:
            if op == ROUTER:
                own, tokens = self.flips[(layer, OWN)]
                accumulated, _ = self.flips[(layer, ACCUMULATED)]
                row = Row(
                    layer=layer,
                    op=op,
                    own=_share(own, tokens),
                    accumulated=_share(accumulated, tokens),
                    tokens=tokens,
                    own_flips=own,
                    accumulated_flips=accumulated,
                )
                if ((layer, op), OWN) in self.squares:
                    row.own_scores = self._relative((layer, op), OWN)
                    row.accumulated_scores = self._relative((layer, op), ACCUMULATED)
                out.append(row)
            else:
                key = (layer, op)
                out.append(
                    Row(
                        layer=layer,
                        op=op,
                        own=self._relative(key, OWN),
                        accumulated=self._relative(key, ACCUMULATED),
                        tokens=self.tokens,
                    )
                )
        return out
