"""The support matrix of docs/engines.md, rendered from the adapter table so that the two cannot drift apart."""

from __future__ import annotations

from mismatch_probe.model.moe.families import ADAPTERS

HEADER = ("family", "`model_type`", "hf capture", "hf R3", "megatron", "megatron R3")


def _mark(supported: bool, min_transformers: str | None = None) -> str:
    if supported and min_transformers:
        return f"yes (transformers >= {min_transformers})"
    return "yes" if supported else "no"


def support_matrix() -> str:
    """Markdown table: one row per family. Every adapter gives hf capture and R3 (its router style reads
    the chosen experts and recomputes the gate weights), from the transformers release it names if any; megatron
    comes from the adapter's flags."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for adapter in ADAPTERS:
        cells = (
            adapter.family,
            ", ".join(f"`{t}`" for t in adapter.model_types),
            _mark(hasattr(adapter.style, "chosen"), adapter.min_transformers),
            _mark(hasattr(adapter.style, "replay"), adapter.min_transformers),
            _mark(adapter.megatron),
            _mark(adapter.megatron_r3),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
