"""The catalogue's last run: a policy comparison's own keys (report/policy/, docs/staleness.md): reference = the
old pass (θ_old), candidate = a new policy's pass; per token a = ℓ_old − μ, s = ℓ_new − ℓ_old, t = a + s,
b = ℓ_new − ℓ_new^N."""

from __future__ import annotations

from mismatch_probe.report.keys.families import (
    PPO_RATIO_FRACTION,
    ROUTER_SHIFT_CLIP_FRACTION,
    RSPO_RATIO_FRACTION,
    TOTAL_TIS_CLIP_FRACTION,
)
from mismatch_probe.report.keys.levels import GAMMA_MIN, threshold_label
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, HIGHER, LOWER, NEITHER, MetricKey

POLICY_NOTE = "policy comparisons only: reference = the θ_old score set, candidate = a new policy's pass"
RSPO = "RSPO (Towards Stable and Effective RL for MoE), eqs. 5-11"

POLICY_KEYS: tuple[MetricKey, ...] = (
    MetricKey(
        name="n_policy_tokens",
        definition="response tokens with a finite log-prob on the rollout, the old and the new pass (and N)",
        unit="tokens",
        direction=NEITHER,
        group="policy",
        note=POLICY_NOTE,
    ),
    *(
        MetricKey(
            name=name,
            definition=definition,
            unit="nats",
            direction=direction,
            group="policy",
            interval=BOOTSTRAP,
            note=POLICY_NOTE,
        )
        for name, definition, direction in (
            ("tid_k3_kl", "mean of exp(a) - 1 - a: k3 of the training-inference factor a = ℓ_old − μ", LOWER),
            ("total_k3_kl", "mean of exp(t) - 1 - t: k3 of the whole IS log-ratio t = a + s = ℓ_new − μ", LOWER),
            ("tid_log_ratio_var", "population variance of a over tokens", LOWER),
            ("stale_log_ratio_var", "population variance of s over tokens", LOWER),
            ("tid_stale_log_ratio_cov", "population covariance of a and s over tokens", NEITHER),
            (
                "total_log_ratio_var",
                "population variance of t over tokens; equals tid_log_ratio_var + stale_log_ratio_var + "
                "2 tid_stale_log_ratio_cov",
                LOWER,
            ),
            ("replay_bias_k3_kl", "mean of exp(b) - 1 - b, b = ℓ_new − ℓ_new^N: what the replay moves; 0 for N", LOWER),
            ("replay_bias_mean", "mean of b = ℓ_new − ℓ_new^N", NEITHER),
            (
                "router_shift_delta_mean",
                "mean over tokens of Δ = mean over MoE layers of (1/K) sum_k abs(log r_new(e_k) − log r_old(e_k)), "
                "e_k the old pass's experts, log r the router's log-softmax, on router row p − 1",
                LOWER,
            ),
        )
    ),
    MetricKey(
        name="router_shift_ratio_mean",
        definition="mean over tokens of γ = exp(−Δ), RSPO's router-shift ratio",
        unit="ratio",
        direction=HIGHER,
        group="policy",
        interval=BOOTSTRAP,
        note=f"{POLICY_NOTE}; {RSPO}: γ per token, logged by its in-loop implementation",
    ),
    MetricKey(
        name=ROUTER_SHIFT_CLIP_FRACTION.pattern,
        definition="fraction of tokens with γ < G (default G = 0.8, RSPO's γ_min)",
        unit="fraction",
        direction=LOWER,
        group="policy",
        interval=BOOTSTRAP,
        values=(threshold_label(GAMMA_MIN),),
        note=f"{POLICY_NOTE}; {RSPO}: the fraction of tokens whose γ is floored at γ_min",
    ),
    MetricKey(
        name="replay_override_rate",
        definition="fraction of (token, MoE layer) routes, on router row p − 1, whose expert set differs from the "
        "natural new pass N's own (0 for N)",
        unit="fraction",
        direction=NEITHER,
        group="policy",
        interval=BOOTSTRAP,
        note=POLICY_NOTE,
    ),
    *(
        MetricKey(
            name=family.pattern,
            definition=f"fraction of tokens with {ratio} {'<' if side == 'below' else '>'} B (--ppo-bounds; "
            "below@0.8, above@1.2 and above@1.27 by default): an upper bound on the PPO clip fraction, "
            "with no advantages offline",
            unit="fraction",
            direction=LOWER,
            group="policy",
            interval=BOOTSTRAP,
            note=POLICY_NOTE + rescaled,
        )
        for families, ratio, rescaled in (
            (PPO_RATIO_FRACTION, "exp(s)", ""),
            (
                RSPO_RATIO_FRACTION,
                "exp(s) max(γ, 0.8)",
                f"; {RSPO}: the IS ratio rescaled by max(γ, γ_min) before clipping",
            ),
        )
        for side, family in families.items()
    ),
    MetricKey(
        name=TOTAL_TIS_CLIP_FRACTION.pattern,
        definition="fraction of tokens with exp(t) > C, t = ℓ_new − μ (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="policy",
        interval=BOOTSTRAP,
        note=POLICY_NOTE,
    ),
)
