"""The key rosetta: each metric key, its formula, and the name each peer framework logs the same number under.

`probe keys` prints it (report/render/terminal/keys.py); scripts/key_table.py writes it into the README. Both read the catalogue, where a peer's
name is declared only when the definition is the peer's exactly (its clamps, caps and averaging).
"""

from __future__ import annotations

from mismatch_probe.report.keys.catalogue import CATALOGUE
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, HIGHER, LOWER, PEERS

DIRECTION = {LOWER: "lower", HIGHER: "higher", "none": "—"}
NONE = "none"


def rows() -> list[dict]:
    """One row per catalogue entry, peers' names under each framework, "none" where it logs no such number."""
    return [
        {
            "key": entry.name,
            "values": list(entry.values),
            "formula": entry.definition,
            "unit": entry.unit,
            "better": DIRECTION[entry.direction],
            "interval": entry.interval == BOOTSTRAP,
            **{peer: entry.peers.get(peer, NONE) for peer in PEERS},
            "note": entry.note,
            "baseline": entry.gate_baseline,
        }
        for entry in CATALOGUE
    ]


def markdown() -> str:
    """The README's key table."""
    header = ["key", "formula", "unit", "better", "95% interval", *PEERS, "note", "--baseline"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows():
        values = f" ({', '.join(row['values'])})" if row["values"] else ""
        peers = [f"`{row[peer]}`" if row[peer] != NONE else NONE for peer in PEERS]
        cells = [f"`{row['key']}`{values}", row["formula"], row["unit"], row["better"]]
        cells += ["yes" if row["interval"] else "—", *peers, row["note"] or "—", "yes" if row["baseline"] else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
