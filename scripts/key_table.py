"""Print docs/metrics.md's metric key table (between `<!-- keys:begin -->` and `<!-- keys:end -->`): the key rosetta
of `probe keys --format markdown`, from the catalogue.

python scripts/key_table.py        # paste its output between the markers; tests/test_catalogue.py checks it
"""

from __future__ import annotations

from mismatch_probe.report.keys.rosetta import markdown


def key_table() -> str:
    return markdown()


if __name__ == "__main__":
    print(key_table())
