"""Checks that a gate's verdict means something: limits that can hold, keys that exist, a baseline of
the same kind of run, and at least one check that compared two numbers. A gate that passes because it
compared nothing would wave every regression through CI, so each of these is unusable input (exit 2).
"""

from __future__ import annotations

import difflib
import math

from mismatch_probe.errors import ProbeError
from mismatch_probe.report.metrics_file import pair_labels
from mismatch_probe.rundir.manifests import RolloutManifest

# Rollout manifest fields that make two runs' metrics comparable: the model, its routing shape, and the
# temperature both sides score at.
MODEL_FIELDS = ("config_hash", "model", "scoring_temperature")
ROUTING_FIELDS = ("num_layers", "top_k", "num_experts", "moe_layer_indices")


def check_limit(value: float, where: str) -> float:
    """An upper limit is a finite number >= 0: a negative one fails every non-negative metric, an
    infinite one passes everything."""
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ProbeError(f"{where}: limit {value!r} is not usable; expected a finite number >= 0")
    return value


def unknown_key(key: str, valid: list[str], where: str) -> ProbeError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ProbeError(f"{where}: unknown metric{hint} (valid keys: {', '.join(valid)})")


def kind_differences(run: RolloutManifest, baseline: RolloutManifest) -> list[str]:
    """One line per way the baseline's rollout is another kind of run than the gated one."""
    lines, fields = [], MODEL_FIELDS + ROUTING_FIELDS
    if run.routing.is_moe != baseline.routing.is_moe:
        kinds = ["MoE" if m.routing.is_moe else "dense" for m in (run, baseline)]
        lines.append(f"the run is {kinds[0]} but the baseline is {kinds[1]}")
        fields = MODEL_FIELDS  # the routing fields differ as a matter of course
    for key in fields:
        mine, theirs = getattr(run, key), getattr(baseline, key)
        if mine != theirs:
            lines.append(f"{key} differs: run {mine!r}, baseline {theirs!r}")
    return lines


def require_compared(
    checks: list,
    run_label: str,
    compared: list[dict],
    baseline_label: str | None = None,
    baseline_compared: list[dict] | None = None,
) -> None:
    """Exit 2 when the gate compared no two numbers: against the baseline (no comparison in common, or
    the metrics null on one side), or at all (the limited metrics null in every comparison)."""
    run_pairs = pair_labels(compared)
    if baseline_compared is not None and all(c.status == "skipped" for c in checks if c.checked == "baseline"):
        raise ProbeError(
            f"gate compares nothing against the baseline: no comparison of {run_label} has a value in both runs "
            f"(run {run_label}: {run_pairs}; baseline {baseline_label}: {pair_labels(baseline_compared)})"
        )
    if not checks:
        raise ProbeError(f"gate compares nothing: {run_label} has no comparison in its metrics.json")
    if all(c.status == "skipped" for c in checks):
        keys = ", ".join(dict.fromkeys(c.metric for c in checks))
        raise ProbeError(
            f"gate compares nothing: every check is skipped ({keys} null in every comparison "
            f"of {run_label}: {run_pairs})"
        )


def summary_counts(checks: list) -> dict:
    return {
        "failed": sum(c.status == "fail" for c in checks),
        "skipped": sum(c.status == "skipped" for c in checks),
        "total": len(checks),
    }


def summary_line(checks: list) -> str:
    counts = summary_counts(checks)
    skipped = f" ({counts['skipped']} skipped)" if counts["skipped"] else ""
    return f"{counts['failed']} of {counts['total']} checks failed{skipped}"
