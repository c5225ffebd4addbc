"""The README's table of demo effects (between `<!-- effects:begin -->` and `<!-- effects:end -->`), with the
sentence naming the sweep's variants that were not significant, from a demo's metrics.json files.

python scripts/effects_table.py demo-run          # print the table of the demo in demo-run/
python scripts/effects_table.py demo-run --write  # record its rows in docs/demo-effects.json, update README.md

tests/test_readme.py keeps the README's table equal to the table of the recorded rows.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mismatch_probe.pipeline.demo.effects import effect_cell, effects, side_cells, sweep_sentence
from mismatch_probe.pipeline.demo.production import PRODUCTION_RUNS
from mismatch_probe.pipeline.demo.sweep import SWEEP_RUN

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "demo-effects.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- effects:begin -->", "<!-- effects:end -->"


def demo_rows(demo: Path) -> list[dict]:
    runs = ("moe", "dense", *(p.name for p in PRODUCTION_RUNS), SWEEP_RUN)
    results = {name: json.loads((demo / name / "report" / "metrics.json").read_text()) for name in runs}
    return effects(results)


def effects_markdown(rows: list[dict]) -> str:
    lines = ["| effect | higher side | lower side | significant |", "|---|---|---|---|"]
    for row in rows:
        high, low = side_cells(row)
        lines.append(f"| {effect_cell(row)} | {high} | {low} | {'yes' if row['separates'] else 'no'} |")
    sentence = sweep_sentence(rows)
    return "\n".join(lines) + (f"\n\n{sentence}" if sentence else "")


def write(rows: list[dict]) -> None:
    RECORDED.write_text(json.dumps(rows, indent=1) + "\n")
    readme = README.read_text()
    table = effects_markdown(rows)
    README.write_text(re.sub(f"{BEGIN}\n(.*?\n)?{END}", lambda _: f"{BEGIN}\n{table}\n{END}", readme, flags=re.S))


if __name__ == "__main__":
    rows = demo_rows(Path(sys.argv[1]))
    if "--write" in sys.argv[2:]:
        write(rows)
    print(effects_markdown(rows))
