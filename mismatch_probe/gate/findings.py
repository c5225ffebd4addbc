"""`probe gate` refuses a run with doctor findings (metrics.json's "findings") unless --allow names each check."""

from __future__ import annotations

from mismatch_probe.doctor.checks.check_list import CHECK_NAMES
from mismatch_probe.doctor.state import FINDINGS_KEY
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json
from mismatch_probe.rundir.layout import Run


def gate_findings(run: Run, allow: list[str]) -> list[dict]:
    """Each finding of the run's metrics.json, with "allowed": whether --allow names its check."""
    unknown = [name for name in allow if name not in CHECK_NAMES]
    if unknown:
        raise ProbeError(f"--allow {unknown[0]}: not a doctor check (one of {', '.join(CHECK_NAMES)})")
    findings = read_json(run.metrics_path).get(FINDINGS_KEY) or []
    return [finding | {"allowed": finding.get("check") in allow} for finding in findings]


def refused(findings: list[dict]) -> bool:
    return any(not f["allowed"] for f in findings)
