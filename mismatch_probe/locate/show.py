"""The terminal's view of a locate: the table of layers × operations, the rule's line, the sentence; and --json."""

from __future__ import annotations

import json
import math

from rich.table import Table

from mismatch_probe.locate.job import LocateResult, as_json
from mismatch_probe.locate.ops import ROUTER
from mismatch_probe.locate.rule import FLOOR_FACTOR, MARGIN
from mismatch_probe.progress import console
from mismatch_probe.report import numbers


def _plain(value):
    """JSON has no inf or nan: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def json_text(result: LocateResult) -> str:
    return json.dumps(_plain(as_json(result)), indent=2)


def print_result(result: LocateResult) -> None:
    verdict = result.verdict
    table = Table(title=f"own and accumulated error per operation, b vs a ({result.tokens} response positions)")
    for name, justify in (("layer", "right"), ("op", "left"), ("own", "right"), ("accumulated", "right"), ("", "left")):
        table.add_column(name, justify=justify)
    for row in result.rows:
        mark = "◀ located" if row is verdict.located else ""
        layer = "" if row.layer is None else str(row.layer)
        table.add_row(layer, row.op, row.cell("own"), row.cell("accumulated"), mark)
    console.print(table)
    floors = ", ".join(f"{op} {numbers.value(v)}" for op, v in verdict.floors.items() if op != ROUTER)
    console.print(
        f"relative L2 over response positions; routers: share of tokens whose expert set differs, and the relative L2 of "
        f"their scores (logits), compared with the relative-L2 rows. An operation stands "
        f"out when its own error is above the float32 floor ({FLOOR_FACTOR:g}·2⁻²⁴·√K: {floors}; a router: more than "
        f"one flipped token) and at least {MARGIN:g}× the next largest own error of its kind.",
        highlight=False,
        markup=False,
    )
    console.print(verdict.sentence, highlight=False, markup=False)
    if result.page is not None:
        console.print(f"page: {result.page}  ({result.seconds:.1f}s)", highlight=False, markup=False)
