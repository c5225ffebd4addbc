"""`probe report`'s terminal view of the policy comparisons: the staleness table and the `policy:` sentence on
R2 against R3. Thirteen columns with an interval each would wrap every row, so the terminal gives intervals
only where the sentence and the plot lean on them (stale k3, replay bias); the page has them all."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report import numbers
from mismatch_probe.report.policy.table import COLUMNS, HEADER, staleness_rows
from mismatch_probe.report.policy.words import replay_bias_sentence

PLAIN = dict(highlight=False, markup=False, soft_wrap=True)
WITH_INTERVAL = ("k3_kl", "replay_bias_k3_kl")


def print_staleness(out, comparisons: list[dict]) -> None:
    sentence = replay_bias_sentence(comparisons)
    if sentence is None:
        return
    table = Table(title="policy staleness (not in the verdict)")
    for name in HEADER:
        table.add_column(name, justify="left" if name in ("step", "replay") else "right")
    for row in staleness_rows(comparisons):
        cells = [
            numbers.with_interval(row.metrics.get(key), row.metrics.get(ci_key(key)) if key in WITH_INTERVAL else None)
            for _, key in COLUMNS
        ]
        table.add_row(Text(row.step_text), Text(row.replay), *(Text(cell) for cell in cells))
    out.print(table)
    out.print(f"policy: {sentence}", **PLAIN)
