"""What to do about mismatch that moved over steps: the causes that fit its shape.

A sudden jump at one step points at something that changed at that step: the trainer's weights synced or
refitted into the engine (a partial or mis-sharded sync, a stale bucket), an engine setting changed between
steps (a restart, a new sampling or batch config), or an fp8 KV cache switched on. A slow rise points at the
policy itself: it drifts from where the engine's numerics were validated, and as its entropy collapses the
few sampled tokens' probabilities sit where bf16 rounding in logits moves them most."""

from __future__ import annotations

from mismatch_probe.report.steps.words import drift_phrase, trend_phrase

# Where to look, not a fix: the setting names are the engines' as of writing (check your version).
JUMP_HOW = {
    "probe": "probe gate RUN --max-drift 2 (in CI, fails the run whose k3 jumps)",
    "slime": "--sglang-kv-cache-dtype auto (no fp8 KV cache); the weight update logs of that step",
}
SLOW_HOW = {
    "probe": "probe gate RUN --history EARLIER_RUN ... (the same setup's earlier runs)",
    "verl": "log actor/entropy beside rollout_corr/k3_kl; a rollout_corr correction bounds the effect",
}


def step_cause(comparison: dict) -> tuple[str, str, dict[str, str]] | None:
    """(title, why, how) for a comparison whose mismatch rose over its steps; None when it did not."""
    drift, trend = comparison.get("drift"), comparison.get("trend")
    label = f"{comparison['reference']} vs {comparison['candidate']}"
    if drift and drift["direction"] == "rise" and drift.get("shape") == "jump":
        why = (
            f"{drift_phrase(drift)} in {label}: a sudden change at one step fits a weight sync or refit, "
            "a changed engine setting, or the fp8 KV cache"
        )
        return f"Find what changed at step {drift['step']}", why, JUMP_HOW
    rising = trend_phrase(trend) if trend and trend["slope"] > 0 else None
    if (drift and drift["direction"] == "rise") or rising:
        said = "; ".join(p for p in (drift_phrase(drift), rising) if p)
        why = f"{said} in {label}: a slow rise fits policy drift and entropy collapse, not a setup change"
        return "Watch policy drift and entropy over the steps", why, SLOW_HOW
    return None
