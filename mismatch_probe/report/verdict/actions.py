"""What to do next: two or three actions derived from a report's numbers, largest effect first.

A setup bug that `probe doctor` found (metrics.json's `findings`) comes first: no number means much
until it is fixed. Then whichever part of the headline comparison's k3 is larger: the part routing
explains (R3 removes it) or the numerical rest (an fp32 lm_head, fp16, a batch-invariant engine).
A quantized rollout (metrics.json's attribution has `quant_share`) gets the quantization actions, ranked by
the part of k3 its quantization explains; a truncated one (`truncation_share`) the truncation action.
An action a `probe sweep` variant measured quotes its effect (metrics.json's `remedies`, remedy_words.py); one
that a sweep could measure and none did says it is unmeasured, with the command.
Each action names the probe command that measures it and the setting in the frameworks people train
with, where one exists (as the frameworks spell them at the time of writing; check your version)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from mismatch_probe.report import numbers
from mismatch_probe.report.steps.causes import step_cause
from mismatch_probe.report.verdict.remedy_words import DETERMINISTIC, FP16, LM_HEAD_FP32, ROUTER_FP32, measured_line
from mismatch_probe.report.verdict.summary import K3, Row, _share_of

FRAMEWORKS = ("probe", "verl", "slime", "nemo_rl")
ROUTING_LARGE = 0.5  # routing explains at least half of k3: replaying it is the first thing to try


@dataclass(frozen=True)
class Action:
    title: str
    why: str
    how: dict[str, str] = field(default_factory=dict)  # framework -> command or config key
    effect: str = ""  # `measured: ...` by a sweep variant, or `unmeasured: ...` with the sweep that would measure it


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


# A quantized rollout (issue 40). The threads each action follows: verl #7519 (ignored_layers matched by
# substring: 56 parameters bf16 in rollout, fp8 in training), NeMo-RL PR #3614 (quantized routers flip expert
# selection), prime-rl PR #3112 (power-of-two scales raised the mismatch), xtuner PR #2044 (quantizing from the
# fp32 master instead of the bf16 export: k3 25x after step 1), NeMo-RL's FP8 guide and miles PR #1678 (TIS).
KEEP_UNQUANTIZED = Action(
    title="Keep the routers and lm_head unquantized",
    why="a quantized router flips expert selection (NeMo-RL PR #3614), and a skip list matched by substring "
    "left 56 parameters in a different precision on each side (verl #7519); list every router and lm_head by "
    "its full module name",
    how={
        "probe": "probe rescore RUN --engine-arg weight_quant=SCHEME (the default weight_quant_skip keeps routers and lm_head)",
        "verl": "the rollout checkpoint's quantization_config.ignored_layers: every router (mlp.gate) and lm_head, by full name",
        "slime": "the fp8 checkpoint's quantization_config.ignored_layers (vLLM/SGLang modules_to_not_convert): routers and lm_head",
    },
)
BLOCK_SCALES = Action(
    title="Prefer block or MX scales to per-tensor scales",
    why="one scale per tensor rounds small weights coarsely (verl #7519); block fp8 (128x128) or MXFP8 keeps "
    "the error local, and power-of-two scales add to it (prime-rl PR #3112: 0.0038 to about 0.006)",
    how={
        "probe": "probe rescore RUN --engine-arg weight_quant=fp8-block128 (against fp8-tensor, mxfp8)",
        "verl": "quantization_config.weight_block_size=[128, 128] in the rollout's fp8 checkpoint (vLLM block fp8)",
        "slime": "an fp8 checkpoint with 128x128 block scales (weight_block_size [128, 128])",
        "nemo_rl": "policy.generation.vllm_cfg.precision=fp8 (DeepSeek-style sub-channel blocks); keep use_weight_pow2_scale false",
    },
)
FROM_BF16 = Action(
    title="Quantize from the bf16-rounded weights the trainer exports",
    why="quantizing from the fp32 master weights instead of the bf16 export made k3 jump 25x after step 1 "
    "(xtuner PR #2044): round to bf16 first, then to fp8, at every weight update",
    how={
        "probe": "probe rescore RUN --dtype bf16 --engine-arg weight_quant=SCHEME (quantizes the weights as loaded in bf16)"
    },
)
TIS_CORRECTION = Action(
    title="Correct the rest with truncated or masked importance sampling (TIS/MIS)",
    why="a quantized rollout stays off-policy by a flat k3 across steps (miles PR #1678: fp8 0.060 against "
    "bf16 1.2e-4); NeMo-RL's FP8 guide turns the importance-sampling correction on with fp8 generation",
    how={
        "verl": "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0",
        "slime": "--use-tis",
        "nemo_rl": "loss_fn.use_importance_sampling_correction=true",
    },
)
TRUNCATION_SETTINGS = {
    "probe": "probe rescore RUN --sampling rollout (the same top-p/top-k on the training side)",
    "verl": "raw log-probs from the rollout engine (vLLM logprobs_mode=raw_logprobs at the sampling temperature)",
    "slime": "log-probs of the full vocabulary at the sampling temperature, not the top-p-renormalised ones",
}


def _share_cut(row: Row, share: dict | None) -> float:
    """What an action removes: the k3 its matched pass removed where the share is measured, else the row's k3."""
    if share is None:
        return row.metrics.get(K3) or 0.0
    return (share["k3_kl_plain"] or 0.0) - (share["k3_kl_matched"] or 0.0)


def quantization_actions(metrics: dict, row: Row, root: Path) -> tuple[float, list[Action]] | None:
    """A quantized rollout: the four actions, weighted by the part of k3 its quantization explains."""
    attribution = metrics.get("attribution") or {}
    if "quant_share" not in attribution:
        return None
    cut = _share_cut(row, _share_of(metrics, row, "quant_share"))
    run = shlex.quote(str(root))
    actions = [
        replace(a, how={k: v.replace("RUN", run) for k, v in a.how.items()})
        for a in (KEEP_UNQUANTIZED, BLOCK_SCALES, FROM_BF16, TIS_CORRECTION)
    ]
    return cut, actions


def truncation_action(metrics: dict, row: Row, root: Path) -> tuple[float, list[Action]] | None:
    """A truncated rollout: raw log-probs at the sampling temperature, or the same truncation on both sides."""
    attribution = metrics.get("attribution") or {}
    if "truncation_share" not in attribution:
        return None
    share = _share_of(metrics, row, "truncation_share")
    cut = _share_cut(row, share)
    why = "the rollout's log-probs are renormalised over its top-p/top-k support; the training side's are not"
    if share is not None:
        why = f"truncated sampling explains {numbers.percent(share['share'], share['share_ci95'])} of k3 in {row.label}"
    run = shlex.quote(str(root))
    return cut, [
        Action(
            title="Compare like with like: raw log-probs at the sampling temperature, or the same truncation on both sides",
            why=why + "; vLLM can return the sampling mask for the training side to apply",
            how={k: v.replace("RUN", run) for k, v in TRUNCATION_SETTINGS.items()},
        )
    ]


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
    router = measured_line(metrics, ROUTER_FP32, root, engine, dtype)  # a router in fp32 flips fewer experts
    effect = router if router.startswith("measured") else ""
    return cut, Action(title=title, why=why, how={"probe": probe, **R3_SETTINGS}, effect=effect)


def numerics_actions(metrics: dict, row: Row, infos: dict, root: Path) -> tuple[float, list[Action]]:
    share = _share_of(metrics, row)
    rest = share["k3_kl_with_replay"] if share else row.metrics.get(K3)
    if not rest:
        return 0.0, []
    where = "left once routing is replayed" if share else f"of {row.label}"
    engine, dtype = _engine_dtype(row, infos)
    run = shlex.quote(str(root))
    head = Action(
        title="Compute the lm_head (logits) in fp32 on both sides",
        why=f"numerics make the k3 {numbers.value(rest)} {where}; the logits' bf16 rounding is their largest single source",
        how={
            "probe": f"probe rescore {run} --engine {engine} --dtype fp32 (the ceiling fp32 reaches)",
            **FP32_HEAD_SETTINGS,
        },
        effect=measured_line(metrics, LM_HEAD_FP32, root, engine, dtype),
    )
    invariant = Action(
        title="Use fp16, or a batch-invariant inference engine",
        why="fp16 keeps 3 more mantissa bits than bf16; batch invariance removes the batch-size dependence of kernels",
        how={
            "probe": "probe generate ... --engine sglang --engine-arg enable_deterministic_inference=true",
            **INVARIANT_SETTINGS,
        },
        effect=_invariant_effect(metrics, infos, root, engine, dtype),
    )
    return rest, [head, invariant]


def _invariant_effect(metrics: dict, infos: dict, root: Path, engine: str, dtype: str) -> str:
    """fp16 is a sweep knob of any training engine; batch invariance one of an sglang rollout only."""
    fp16 = measured_line(metrics, FP16, root, engine, dtype)
    invariant = measured_line(metrics, DETERMINISTIC, root, engine, dtype)
    rollout = infos.get("rollout")
    if invariant.startswith("unmeasured") and (rollout is None or rollout.engine != "sglang"):
        name = rollout.engine if rollout is not None else "this"
        invariant = (
            f"batch invariance unmeasured: the {name} rollout engine has no knob for it "
            "(an sglang rollout's enable_deterministic_inference is one)"
        )
    return f"{fp16}; {invariant}"


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
        production = [p for p in (quantization_actions(metrics, row, root), truncation_action(metrics, row, root)) if p]
        ranked += production
        limit += sum(len(group) for _, group in production)  # each production action is shown: they go together
        for _, group in sorted(ranked, key=lambda item: -item[0]):
            actions += group
    return actions[:limit]
