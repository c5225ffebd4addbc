"""The page's folded "How this was measured" section, for a run `probe diagnose` planned: every pass of
RUN/diagnose/plan.json with its status, its seconds and the stand-alone command that does it again. Read as a
file (the pipeline that writes it is a layer above the page); a run without a plan gets no section."""

from __future__ import annotations

import json
from html import escape

from mismatch_probe.rundir.layout import DIAGNOSE, PLAN_FILE, Run
from mismatch_probe.rundir.location import is_remote


def read_plan(run: Run) -> dict | None:
    path = run.root / DIAGNOSE / PLAN_FILE
    if is_remote(path) or not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a plan that cannot be read costs the page only this section
    return plan if isinstance(plan, dict) and isinstance(plan.get("passes"), list) else None


def _row(p: dict) -> str:
    status = "this page" if p.get("name") == "report" else str(p.get("status", ""))
    seconds = p.get("seconds")
    said = f"{status}: {p['why']}" if p.get("why") else status
    return (
        f"<tr><td>{escape(str(p.get('name', '')))}</td><td>{escape(said)}</td>"
        f"<td class=num>{'' if seconds is None else f'{seconds:.1f}'}</td>"
        f"<td>{escape(str(p.get('question', '')))}</td><td><code>{escape(str(p.get('command', '')))}</code></td></tr>"
    )


def measured_section(run: Run) -> str:
    plan = read_plan(run)
    if plan is None:
        return ""
    passes = [p for p in plan["passes"] if isinstance(p, dict)]
    loads = plan.get("checkpoint_loads") or {}
    budget = plan.get("budget_s")
    said = f"{len(passes)} passes planned by <code>probe diagnose</code>" + (
        f" within a budget of {budget:g} s" if isinstance(budget, (int, float)) else ""
    )
    if loads:
        said += f"; training checkpoint loads: {escape(str(loads.get('made')))} (planned {escape(str(loads.get('planned')))})"
    head = "".join(f"<th>{h}</th>" for h in ("pass", "status", "seconds", "question", "command"))
    body = "".join(_row(p) for p in passes)
    return (
        '<section id="measured"><details><summary>How this was measured</summary>'
        f"<p>{said}. Each command does its pass again by hand; RUN/diagnose/plan.json holds the plan.</p>"
        f'<div class="scroll"><table class="measured"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        "</details></section>"
    )
