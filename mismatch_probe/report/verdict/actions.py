"""What to do next: two or three actions derived from a report's numbers, largest effect first.

A setup bug that `probe doctor` found (metrics.json's `findings`) comes first: no number means much
until it is fixed. Then whichever part of the headline comparison's k3 is larger: the part routing
explains (R3 removes it) or the numerical rest (an fp32 lm_head, fp16, a batch-invariant engine).
Each action names the probe command that measures it and the setting in the frameworks people train
with, where one exists (as the frameworks spell them at the time of writing; check your version)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from mismatch_probe.report import numbers
from mismatch_probe.report.steps.causes import step_cause
from mismatch_probe.report.verdict.summary import K3, Row, _share_of

FRAMEWORKS = ("probe", "verl", "slime", "nemo_rl")
ROUTING_LARGE = 0.5  # routing explains at least half of k3: replaying it is the first thing to try


@dataclass(frozen=True)
class Action:
    title: str
    why: str
    how: dict[str, str] = field(default_factory=dict)  # framework -> command or config key


R3_SETTINGS = {
    "verl": "actor_rollout_ref.actor.megatron.router_replay.mode=R3 actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
    "slime": "--use-rollout-routing-replay",
}
FP32_HEAD_SETTINGS = {"slime": "--sglang-enable-fp32-lm-head"}
INVARIANT_SETTINGS = {
    "verl": "VLLM_BATCH_INVARIANT=1 in the rollout workers' environment (vLLM)",
    "slime": "--true-on-policy-mode",
    "nemo_rl": "policy.precision=float16 (fp16 on both sides)",
}


def _engine_dtype(row: Row, infos: dict) -> tuple[str, str]:
    cand = infos.get(row.names[0][1])
    return (cand.engine if cand else "hf"), (cand.dtype if cand and cand.dtype else "bf16")


def setup_actions(findings: list[dict]) -> list[Action]:
    out = []
    for f in findings:
        fix = f.get("fix") or {}
        how = {name: str(fix[name]) for name in FRAMEWORKS if fix.get(name)}
        why = "; ".join(str(f[key]) for key in ("found", "cause") if f.get(key))
        out.append(Action(title=f"Fix the setup: {f.get('check', 'setup check')}", why=why, how=how))
    return out


def routing_action(metrics: dict, row: Row, infos: dict, root: Path) -> tuple[float, Action] | None:
    share = _share_of(metrics, row)
    engine, dtype = _engine_dtype(row, infos)
    probe = f"probe rescore {shlex.quote(str(root))} --engine {engine} --dtype {dtype} --replay r3"
    if share is None:
        router = row.metrics.get("router_diff_rate")
        if not router:
            return None
        why = f"{numbers.percent(router)} of (token, layer) routings differ; R3 replays the rollout's experts"
        return 0.0, Action(
            title="Measure what routing replay (R3) removes", why=why, how={"probe": probe, **R3_SETTINGS}
        )
    cut = share["k3_kl_without_replay"] - (share["k3_kl_with_replay"] or 0.0)
    why = (
        f"routing explains {numbers.percent(share['share'], share['share_ci95'])} of k3 in {row.label}; "
        f"with R3 it falls from {numbers.value(share['k3_kl_without_replay'])} to "
        f"{numbers.value(share['k3_kl_with_replay'])}"
    )
    title = "Replay the rollout's routing in training (R3)"
    return cut, Action(title=title, why=why, how={"probe": probe, **R3_SETTINGS})


def numerics_actions(metrics: dict, row: Row, infos: dict, root: Path) -> tuple[float, list[Action]]:
    share = _share_of(metrics, row)
    rest = share["k3_kl_with_replay"] if share else row.metrics.get(K3)
    if not rest:
        return 0.0, []
    where = "left once routing is replayed" if share else f"of {row.label}"
    engine, _ = _engine_dtype(row, infos)
    run = shlex.quote(str(root))
    head = Action(
        title="Compute the lm_head (logits) in fp32 on both sides",
        why=f"numerics make the k3 {numbers.value(rest)} {where}; the logits' bf16 rounding is their largest single source",
        how={
            "probe": f"probe rescore {run} --engine {engine} --dtype fp32 (the ceiling fp32 reaches)",
            **FP32_HEAD_SETTINGS,
        },
    )
    invariant = Action(
        title="Use fp16, or a batch-invariant inference engine",
        why="fp16 keeps 3 more mantissa bits than bf16; batch invariance removes the batch-size dependence of kernels",
        how={
            "probe": "probe generate ... --engine sglang --engine-arg enable_deterministic_inference=true",
            **INVARIANT_SETTINGS,
        },
    )
    return rest, [head, invariant]


def step_actions(metrics: dict, row: Row | None) -> list[Action]:
    """The headline comparison's mismatch rose over the run's steps: the causes that fit a jump or a slow rise."""
    if row is None:
        return []
    cause = step_cause(metrics["comparisons"][row.indices[0]])
    return [] if cause is None else [Action(title=cause[0], why=cause[1], how=cause[2])]


def next_actions(metrics: dict, row: Row | None, infos: dict, root: Path, limit: int = 3) -> list[Action]:
    """Setup fixes first, then the routing and numerics actions ordered by the part of k3 each addresses."""
    actions = setup_actions(metrics.get("findings") or [])
    actions += step_actions(metrics, row)
    if row is not None and row.metrics.get(K3):
        ranked = []
        routing = routing_action(metrics, row, infos, root)
        if routing is not None:
            ranked.append((routing[0], [routing[1]]))
        ranked.append(numerics_actions(metrics, row, infos, root))
        for _, group in sorted(ranked, key=lambda item: -item[0]):
            actions += group
    return actions[:limit]
