"""Reading a run's report/metrics.json (SPEC section 5) for gate and compare: its schema version, its shape
and its values, checked here once so that its readers take every number as a number.

A metrics.json of another schema version may name the same keys with other meanings, so it is refused,
not read: the run's report is computed again by this version (`probe report RUN`).
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import CI_SUFFIX
from mismatch_probe.jsonfile import read_json

METRICS_SCHEMA_VERSION = 1


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: Path, run_root: Path) -> dict:
    """metrics.json checked to be this version's: schema_version, each comparison's three fields, and each
    metric a number or null (an interval `KEY_ci95`: [low, high] or null)."""
    metrics = read_json(path)
    version = metrics.get("schema_version")
    if version != METRICS_SCHEMA_VERSION or isinstance(version, bool):
        raise ProbeError(
            f"{path}: schema_version {version!r}, expected {METRICS_SCHEMA_VERSION} "
            f"(re-run `probe report {run_root}` with this version)"
        )
    if not isinstance(metrics.get("comparisons"), list):
        raise ProbeError(f"{path}: expected {{'schema_version': 1, 'comparisons': [...]}}")
    for i, comp in enumerate(metrics["comparisons"]):
        if not (
            isinstance(comp, dict)
            and isinstance(comp.get("reference"), str)
            and isinstance(comp.get("candidate"), str)
            and isinstance(comp.get("metrics"), dict)
        ):
            raise ProbeError(
                f"{path}: comparisons[{i}]: expected {{'reference': ..., 'candidate': ..., 'metrics': {{...}}}}"
            )
        for key, value in comp["metrics"].items():
            where = f"{path}: {comp['reference']} vs {comp['candidate']}: {key} is {value!r}"
            if key.endswith(CI_SUFFIX):
                if value is not None and not (
                    isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
                ):
                    raise ProbeError(f"{where}, expected [low, high]")
            elif value is not None and not _is_number(value):
                raise ProbeError(f"{where}, expected a number or null")
    return metrics


def pair_labels(comparisons: list[dict]) -> str:
    """`rollout:scores/a, scores/a:scores/b`, or `none`: comparisons as --pair spells them."""
    return ", ".join(f"{c['reference']}:{c['candidate']}" for c in comparisons) or "none"
