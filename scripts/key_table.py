"""Print docs/metrics.md's metric key table (between `<!-- keys:begin -->` and `<!-- keys:end -->`) from the catalogue.

python scripts/key_table.py        # paste its output between the markers; tests/test_catalogue.py checks it
"""

from __future__ import annotations

from mismatch_probe.report.catalogue import BOOTSTRAP, CATALOGUE, HIGHER, LOWER

DIRECTION = {LOWER: "lower", HIGHER: "higher", "none": "—"}


def key_table() -> str:
    rows = [
        "| key | definition | unit | better | 95% interval | peers' name | --baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in CATALOGUE:
        peers = ", ".join(f"{framework} `{name}`" for framework, name in key.peers.items()) or "—"
        values = f" ({', '.join(key.values)})" if key.values else ""
        rows.append(
            f"| `{key.name}`{values} | {key.definition} | {key.unit} | {DIRECTION[key.direction]} | "
            f"{'yes' if key.interval == BOOTSTRAP else '—'} | {peers} | {'yes' if key.gate_baseline else '—'} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(key_table())
