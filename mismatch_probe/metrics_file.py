"""Reading a run's report/metrics.json (SPEC section 5) for gate and compare: its schema version and shape.

A metrics.json of another schema version may name the same keys with other meanings, so it is refused,
not read: the run's report is computed again by this version (`probe report RUN`).
"""

from __future__ import annotations

from pathlib import Path

from .errors import ProbeError
from .jsonfile import read_json

METRICS_SCHEMA_VERSION = 1


def read_metrics(path: Path, run_root: Path) -> dict:
    """metrics.json checked to be this version's: schema_version, then each comparison's three fields."""
    metrics = read_json(path)
    version = metrics.get("schema_version")
    if version != METRICS_SCHEMA_VERSION or isinstance(version, bool):
        raise ProbeError(f"{path}: schema_version {version!r}, expected {METRICS_SCHEMA_VERSION} "
                         f"(re-run `probe report {run_root}` with this version)")  # fmt: skip
    if not isinstance(metrics.get("comparisons"), list):
        raise ProbeError(f"{path}: expected {{'schema_version': 1, 'comparisons': [...]}}")
    for i, comp in enumerate(metrics["comparisons"]):
        if not (
            isinstance(comp, dict) and isinstance(comp.get("reference"), str)
            and isinstance(comp.get("candidate"), str) and isinstance(comp.get("metrics"), dict)
        ):  # fmt: skip
            raise ProbeError(f"{path}: comparisons[{i}]: expected {{'reference': ..., 'candidate': ..., 'metrics': {{...}}}}")
    return metrics


def pair_labels(comparisons: list[dict]) -> str:
    """`rollout:scores/a, scores/a:scores/b`, or `none`: comparisons as --pair spells them."""
    return ", ".join(f"{c['reference']}:{c['candidate']}" for c in comparisons) or "none"
