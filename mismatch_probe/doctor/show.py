"""The doctor's terminal view and JSON: one block per finding."""

from __future__ import annotations

import json

from rich.panel import Panel
from rich.text import Text

from mismatch_probe.doctor.finding import FIX_KEYS, Finding
from mismatch_probe.progress import stdout_console

FIX_LABELS = {"probe": "probe", "verl": "verl", "slime": "slime", "nemo_rl": "NeMo-RL"}


def findings_json(findings: list[Finding]) -> str:
    return json.dumps({"healthy": not findings, "findings": [f.to_json() for f in findings]}, indent=2)


def print_findings(findings: list[Finding], run) -> None:
    out = stdout_console()
    if not findings:
        out.print(f"doctor: {run}: healthy, no finding", highlight=False, markup=False)
        return
    for finding in findings:
        body = Text()
        body.append("found: ", style="bold")
        body.append(finding.found + "\n")
        body.append("cause: ", style="bold")
        body.append(finding.cause + "\n")
        for key in FIX_KEYS:
            if finding.fix.get(key):
                body.append(f"fix ({FIX_LABELS[key]}): ", style="bold")
                body.append(finding.fix[key] + "\n")
        out.print(Panel(renderable=body, title=f"[bold red]{finding.check}[/]", title_align="left"))
    names = ", ".join(dict.fromkeys(f.check for f in findings))
    out.print(f"doctor: {run}: {len(findings)} finding(s): {names}", highlight=False, markup=False)
    # The versions behind the run matter to every finding: the manifest records the run's, `probe env` this one's.
    out.print(
        "doctor: a finding you think is wrong, or an engine bug to report: attach `probe env --json`",
        highlight=False,
        markup=False,
    )
