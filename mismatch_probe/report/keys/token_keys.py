"""The catalogue's first run: the per-token keys of every comparison (log-probabilities, token probabilities,
F(T)) and the counts of tokens compared and left out."""

from __future__ import annotations

from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, HIGHER, LOWER, NEITHER, MetricKey, verl_peer

TOKEN_KEYS: tuple[MetricKey, ...] = (
    MetricKey(
        name="n_tokens",
        definition="response tokens with a finite log-prob on both sides (the compared tokens)",
        unit="tokens",
        direction=NEITHER,
        group="probability",
    ),
    MetricKey(
        name="k3_kl",
        definition="mean of r - 1 - log r (Schulman's k3)",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
        peers=verl_peer("k3_kl")
        | {"NeMo-RL": "gen_kl_error (reference_policy_kl_type: k3)", "prime-rl": "mismatch_kl/all/mean"},
        note="slime/miles average per sequence first",
    ),
    MetricKey(
        name="k1_kl",
        definition="mean of -log r",
        unit="nats",
        direction=NEITHER,
        group="probability",
        interval=BOOTSTRAP,
        peers=verl_peer("kl"),
        note="in a policy comparison (θ_old pass vs a new policy's pass) this is k1 of s = ℓ_new − ℓ_old: "
        "verl's actor/ppo_kl",
    ),
    MetricKey(
        name="k2_kl",
        definition="mean of 0.5 (log r)^2",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
        note="verl's rollout_rs_token_k2_mean clamps delta to [-20, 20] first: it differs where abs(delta) > 20",
    ),
    MetricKey(
        name="abs_logprob_diff_mean",
        definition="mean of abs(delta)",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
        note="slime/miles train_rollout_logprob_abs_diff is a mean over sequences of each one's mean",
    ),
    MetricKey(
        name="abs_logprob_diff_max", definition="max of abs(delta)", unit="nats", direction=LOWER, group="probability"
    ),
    *(  # verl's calculate_debug_metrics (verl/utils/debug/metrics.py), over the response tokens
        MetricKey(
            name=f"abs_prob_diff_{stat}",
            definition=f"{definition} of abs(p_cand - p_ref)",
            unit="probability",
            direction=LOWER,
            group="probability",
            peers={"verl": f"training/rollout_probs_diff_{stat}"},
            note="prob_diff_std is the population std of the signed difference" if stat == "std" else "",
        )
        for stat, definition in (("mean", "mean"), ("max", "max"), ("std", "sample std (n - 1) over tokens"))
    ),
    MetricKey(
        name="prob_diff_std",
        definition="population std of p_cand - p_ref over tokens",
        unit="probability",
        direction=LOWER,
        group="probability",
        note="MiniMax-M1's report plots this spread (its code is not public: definition not checked)",
    ),
    MetricKey(
        name="prob_corr",
        definition="Pearson correlation of p_ref and p_cand over tokens",
        unit="correlation",
        direction=HIGHER,
        group="probability",
        peers={"verl": "training/rollout_actor_probs_pearson_corr"},
        note="MiniMax-M1's report gives this correlation "
        "(0.987 before, 0.997 after its LM-head fix; its code is not public: definition not checked)",
    ),
    MetricKey(
        name="kept_logmass_diff_mean",
        definition="mean of kept_logmass_ref - kept_logmass_cand over response tokens where both sides record it "
        "(the log mass of each side's top-p/top-k support; processed log-prob = raw - kept_logmass, so it adds "
        "to delta); only where both sides have the column",
        unit="nats",
        direction=NEITHER,
        group="probability",
        interval=BOOTSTRAP,
    ),
    MetricKey(
        name=EXTREME_FRACTION.pattern,
        definition="F(T): fraction of tokens with max(r, 1/r) > T (--thresholds)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="argmax_flip_rate",
        definition="fraction of response positions whose top_token_id differs (both sides have it)",
        unit="fraction",
        direction=LOWER,
        group="probability",
    ),
    MetricKey(
        name="logprob_bit_mismatch_fraction",
        definition="fraction of response tokens with a log-prob on both sides whose float32 values differ in any "
        "bit (+0 and -0 equal; a NaN differs): 0 on a bitwise-equal comparison",
        unit="fraction",
        direction=LOWER,
        group="probability",
        peers={"prime-rl": "logprob_bit_mismatch/all/mean (where no -0 meets +0 and no inf meets inf)"},
        note="prime-rl compares the int32 bit patterns and counts every non-finite pair: -0 against +0, or inf "
        "against inf, is a mismatch there and not here",
    ),
    MetricKey(
        name="logprob_bit_mismatch_count",
        definition="response tokens with a log-prob on both sides whose float32 values differ in any bit",
        unit="tokens",
        direction=LOWER,
        group="count",
        peers={"verl": "training/rollout_logprobs_mismatch_count"},
        note="verl logs it since PR #8025 (after 0.9.1), over valid response tokens; checked against 0.9.1's "
        "calculate_token_list_diff (verl/utils/debug/metrics.py), its != count; docs/advance/determinism.md reads it "
        "for batch-invariant runs",
    ),
    MetricKey(name="n_response_tokens", definition="response tokens", unit="tokens", direction=NEITHER, group="count"),
    MetricKey(
        name="n_skipped",
        definition="response tokens not compared (n_response_tokens - n_tokens)",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_null_ref",
        definition="response tokens whose reference log-prob is null",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_null_cand",
        definition="response tokens whose candidate log-prob is null",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_nonfinite_ref",
        definition="response tokens whose reference log-prob is NaN or inf",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_nonfinite_cand",
        definition="response tokens whose candidate log-prob is NaN or inf",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_outside_support",
        definition="response tokens a side recording kept_logmass scored with a null log-prob: sampled outside "
        "that side's own top-p/top-k support (--sampling rollout), left out of every mean; only where both sides "
        "have the column, or one has it and its manifest declares processed log-probs",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_argmax_compared",
        definition="response positions with top_token_id on both sides",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
)
