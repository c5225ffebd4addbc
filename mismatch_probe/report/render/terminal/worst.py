"""`probe report --worst N` in the terminal: a table of each comparison's worst tokens, read from metrics.json."""

from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from mismatch_probe.progress import stdout_console
from mismatch_probe.report.numbers import value

CONTEXT_CHARS = 48  # the end of the decoded context shown before the token


def shown(text: str | None) -> str | None:
    """Model text on one line: newlines, tabs and control characters escaped as in JSON."""
    return None if text is None else json.dumps(text, ensure_ascii=False)[1:-1]


def _token_cell(text: str | None, token_id: int | None) -> Text:
    # Text, not a markup string: model output may hold [brackets] that rich would take for styles.
    if token_id is None:
        return Text("-", style="dim")
    if text is None:
        return Text(f"id {token_id}", style="dim")
    return Text(json.dumps(text, ensure_ascii=False))  # quoted, so leading spaces show


def _context_cell(entry: dict) -> Text:
    context = entry["context"]
    if context["response_before"] is None:
        return Text("(no text)", style="dim")
    before = shown((context["prompt_tail"] or "") + context["response_before"])
    cell = Text("…" + before[-CONTEXT_CHARS:] if len(before) > CONTEXT_CHARS else before)
    cell.append(shown(entry["token"]), style="bold red")
    return cell


def worst_table(comparison: dict) -> Table:
    table = Table(title=Text(f"worst tokens: {comparison['reference']} vs {comparison['candidate']}"))
    for name in ("sample", "pos", "resp", "token", "p_ref", "p_cand", "delta", "top ref", "top cand", "routing"):
        table.add_column(name, justify="left" if name in ("token", "top ref", "top cand") else "right")
    table.add_column("context", overflow="fold")
    for e in comparison["worst_tokens"]:
        routing = "-" if e["routing_diff_layers"] is None else str(e["routing_diff_layers"])
        table.add_row(
            str(e["sample_id"]),
            str(e["position"]),
            str(e["response_index"]),
            _token_cell(e["token"], e["token_id"]),
            value(e["p_ref"]),
            value(e["p_cand"]),
            ("+" if e["delta"] > 0 else "") + value(e["delta"]),
            _token_cell(e["top_token_ref"], e["top_token_id_ref"]),
            _token_cell(e["top_token_cand"], e["top_token_id_cand"]),
            routing,
            _context_cell(e),
        )
    return table


def print_worst(metrics: dict) -> None:
    out = stdout_console()
    for comparison in metrics["comparisons"]:
        if comparison["worst_tokens"]:
            out.print(worst_table(comparison))
        else:
            out.print(Text(f"worst tokens: {comparison['reference']} vs {comparison['candidate']}: no compared token"))
