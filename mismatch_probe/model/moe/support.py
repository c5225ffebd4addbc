"""The support matrix of docs/engines.md, rendered from the adapter table so that the two cannot drift apart."""

from __future__ import annotations

from mismatch_probe.model.moe.families import ADAPTERS

HEADER = ("family", "`model_type`", "hf capture", "hf R3", "megatron", "megatron R3")


def _mark(supported: bool) -> str:
    return "yes" if supported else "no"


def support_matrix() -> str:
    """Markdown table: one row per family. Every adapter gives hf capture and R3 (its router style reads
    the chosen experts and recomputes the gate weights); megatron comes from the adapter's flags."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for adapter in ADAPTERS:
        cells = (
            adapter.family,
            ", ".join(f"`{t}`" for t in adapter.model_types),
            _mark(hasattr(adapter.style, "chosen")),
            _mark(hasattr(adapter.style, "replay")),
            _mark(adapter.megatron),
            _mark(adapter.megatron_r3),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
