"""Every key of a comparison's `metrics` (SPEC section 5), declared once, in the order metrics.json writes them.

metrics.json's key order, the HTML report's tables, the gate's baseline keys, compare's and the demo's
columns and the key table of docs/metrics.md all read this list; adding a key touches only this file and the
accumulator that computes it. A family (`extreme_fraction@T`) is declared once under its pattern: the
part after `@` is a parameter, either given by the user (thresholds, caps, bounds) or one of fixed `values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch_probe.frames.bootstrap import CI_SUFFIX
from mismatch_probe.report.accumulators.verl_correction import MODES

LOWER, HIGHER, NEITHER = "lower_is_better", "higher_is_better", "none"
BOOTSTRAP = "bootstrap over sequences"  # KEY_ci95 beside the key, see bootstrap.py
GROUPS = ("probability", "threshold", "routing", "correction", "verl", "count", "policy")
# The frameworks of the key rosetta (`probe keys`), in its column order.
PEERS = ("verl", "slime/miles", "NeMo-RL", "prime-rl")
# verl 0.9.1's token-level truncated IS (verl/trainer/ppo/rollout_corr_helper.py, compute_is_metrics)
VERL_TIS = " (rollout_is: token, rollout_is_threshold: C)"


@dataclass(frozen=True)
class MetricKey:
    name: str  # the exact key, or a family's pattern: "extreme_fraction@T"
    definition: str  # formula text; delta = logprob_cand - logprob_ref, r = exp(delta), over compared tokens
    unit: str
    direction: str  # LOWER, HIGHER or NEITHER (signed, or a count)
    group: str  # one of GROUPS: the table of the HTML report it lands in
    interval: str = NEITHER  # BOOTSTRAP where the report writes KEY_ci95
    # Peers' name for exactly this definition (SPEC: a key that shares a peer's name computes the peer's
    # definition). Frameworks not listed log no metric of this definition that we know of.
    peers: dict[str, str] = field(default_factory=dict)
    # What a reader of a peer's logs should know: the nearest peer metric and how it differs.
    note: str = ""
    # The gate's default: compared with a --baseline run when --max names no key with an interval.
    # No key has a default limit: limits are the user's.
    gate_baseline: bool = False
    values: tuple[str, ...] = ()  # a family's fixed parameters; empty: the user's (--thresholds, ...)

    @property
    def prefix(self) -> str | None:
        """`extreme_fraction@` for a family, None for a plain key."""
        head, at, _ = self.name.partition("@")
        return head + at if at else None

    def names(self) -> tuple[str, ...]:
        """The concrete keys: the name, or each fixed value of a family (none for a user-parameter family)."""
        if self.prefix is None:
            return (self.name,)
        return tuple(self.prefix + value for value in self.values)

    def matches(self, key: str) -> bool:
        """Whether `key` is this key, or one of this family's (not its interval, `extreme_fraction@2_ci95`)."""
        if self.prefix is None or not key.startswith(self.prefix):
            return key == self.name
        return key in self.names() if self.values else not key.endswith(CI_SUFFIX)


def _verl(name: str, config: str = "") -> dict[str, str]:
    return {"verl": f"rollout_corr/{name}{config}"}


EVERY_SEQUENCE = "mean over every sequence (an empty response counts with a sequence mean of 0)"


CATALOGUE: tuple[MetricKey, ...] = (
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
        peers=_verl("k3_kl")
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
        peers=_verl("kl"),
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
        name="extreme_fraction@T",
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
        name="n_argmax_compared",
        definition="response positions with top_token_id on both sides",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="router_diff_rate",
        definition="fraction of (token, MoE layer) pairs whose expert sets differ",
        unit="fraction",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="router_diff_mean",
        definition="mean differing experts per (token, MoE layer): top_k - abs(S_ref & S_cand)",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="token_diff_rate",
        definition="fraction of tokens with a differing expert in some MoE layer",
        unit="fraction",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="token_diff_mean",
        definition="mean over tokens of the differing experts summed over layers",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="seq_router_diff_mean",
        definition="mean over sequences of the per-token differing-expert count",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="n_routing_tokens",
        definition="tokens with routing on both sides (routing scope)",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_routing_sequences",
        definition="sequences with routing on both sides",
        unit="sequences",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_tokens@SPLIT",
        definition="compared tokens with routing on both sides whose expert sets are "
        "identical in every MoE layer (routing_same) / differ in one (routing_diff)",
        unit="tokens",
        direction=NEITHER,
        group="routing",
        values=("routing_same", "routing_diff"),
    ),
    MetricKey(
        name="k3_kl@SPLIT",
        definition="k3_kl over the n_tokens@SPLIT tokens",
        unit="nats",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        values=("routing_same", "routing_diff"),
    ),
    MetricKey(
        name="log_ppl_diff",
        definition=f"{EVERY_SEQUENCE} of -mean(delta)",
        unit="nats",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("log_ppl_diff"),
    ),
    *(
        MetricKey(
            name=f"log_ppl_diff_{stat}",
            definition=f"{stat} over every sequence of -mean(delta) (0 for an empty response)",
            unit="nats",
            direction=NEITHER,
            group="verl",
            peers=_verl(f"log_ppl_diff_{stat}"),
        )
        for stat in ("max", "min")
    ),
    MetricKey(
        name="log_ppl_abs_diff",
        definition=f"{EVERY_SEQUENCE} of abs(mean(delta))",
        unit="nats",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("log_ppl_abs_diff"),
        gate_baseline=True,
    ),
    MetricKey(
        name="ppl_ratio",
        definition=f"{EVERY_SEQUENCE} of exp(-mean(delta))",
        unit="ratio",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("ppl_ratio"),
    ),
    *(
        MetricKey(
            name=f"{prefix}ppl_{side}",
            definition=f"{EVERY_SEQUENCE} of {exp_open}-mean(logprob_{side}){exp_close}",
            unit="nats" if prefix else "ratio",
            direction=NEITHER,
            group="verl",
            interval=BOOTSTRAP,
            peers=_verl(f"{verl_side}_{prefix}ppl"),
        )
        for prefix, exp_open, exp_close in (("", "exp(", ")"), ("log_", "", ""))
        for side, verl_side in (("ref", "rollout"), ("cand", "training"))
    ),
    MetricKey(
        name="chi2_token",
        definition="mean of r^2 - 1, delta clamped to [-20, 20]",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("chi2_token"),
        gate_baseline=True,
    ),
    MetricKey(
        name="chi2_seq",
        definition=f"{EVERY_SEQUENCE} of exp(2 sum(delta)) - 1, the sum clamped to [-20, 20]",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("chi2_seq"),
        gate_baseline=True,
    ),
    MetricKey(
        name="mult_prob_error",
        definition="mean of max(r, 1/r) = exp(abs(delta))",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers={"NeMo-RL": "token_mult_prob_error"},
    ),
    MetricKey(
        name="is_ess",
        definition="(sum r)^2 / (n sum r^2): normalised effective sample size of the untruncated token weights",
        unit="fraction",
        direction=HIGHER,
        group="correction",
        interval=BOOTSTRAP,
        note="verl's rollout_is_eff_sample_size truncates the weights at C first: that is is_ess@C",
    ),
    *(
        MetricKey(
            name=f"{name}@C",
            definition=f"{definition}; w = min(exp(delta clamped to [-20, 20]), C) (--tis-caps)",
            unit=unit,
            direction=direction,
            group="verl",
            interval=interval,
            peers=_verl(f"rollout_is_{verl}", VERL_TIS),
        )
        for name, verl, definition, unit, direction, interval in (
            ("is_ess", "eff_sample_size", "(sum w)^2 / (n sum w^2) over tokens", "fraction", HIGHER, BOOTSTRAP),
            ("is_mean", "mean", "mean of w over tokens", "ratio", NEITHER, BOOTSTRAP),
            ("is_std", "std", "population std of w over tokens", "ratio", LOWER, BOOTSTRAP),
            ("is_min", "min", "min of w over tokens", "ratio", NEITHER, NEITHER),
            ("is_max", "max", "max of w over tokens", "ratio", NEITHER, NEITHER),
            ("is_fraction_low", "ratio_fraction_low", "fraction of tokens with w < 1/C", "fraction", LOWER, BOOTSTRAP),
            ("is_seq_mean", "seq_mean", f"{EVERY_SEQUENCE} of mean(w)", "ratio", NEITHER, BOOTSTRAP),
            ("is_seq_std", "seq_std", "sample std (n - 1) over every sequence of mean(w)", "ratio", LOWER, BOOTSTRAP),
            ("is_seq_min", "seq_min", "min over every sequence of mean(w) (0 if empty)", "ratio", NEITHER, NEITHER),
            ("is_seq_max", "seq_max", "max over every sequence of mean(w) (0 if empty)", "ratio", NEITHER, NEITHER),
            (
                "is_seq_max_deviation",
                "seq_max_deviation",
                "max over every sequence of abs(mean(w) - 1)",
                "ratio",
                LOWER,
                NEITHER,
            ),
            (
                "is_seq_fraction_high",
                "seq_fraction_high",
                "fraction of every sequence with mean(exp(delta clamped)) > C",
                "fraction",
                LOWER,
                BOOTSTRAP,
            ),
            (
                "is_seq_fraction_low",
                "seq_fraction_low",
                "fraction of every sequence with mean(exp(delta clamped)) < 1/C (an empty one counts)",
                "fraction",
                LOWER,
                BOOTSTRAP,
            ),
        )
    ),
    MetricKey(
        name="tis_clip_fraction@C",
        definition="fraction of tokens with r > C, delta clamped to [-20, 20] (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
        peers=_verl("rollout_is_ratio_fraction_high", VERL_TIS),
        note="slime/miles tis_clipfrac also counts the tokens below its lower clip",
    ),
    *(
        MetricKey(
            name=f"{name}@C",
            definition=f"{definition}; W = min(exp(sum(delta) clamped to [-20, 20]), C), one weight per sequence "
            "(--tis-caps)",
            unit=unit,
            direction=direction,
            group="verl",
            interval=BOOTSTRAP,
            peers=_verl(f"rollout_is_{verl}", " (rollout_is: sequence, rollout_is_threshold: C)"),
        )
        for name, verl, definition, unit, direction in (
            ("seq_is_ess", "eff_sample_size", "(sum n W)^2 / (N sum n W^2), n a sequence's tokens", "fraction", HIGHER),
            ("seq_is_mean", "mean", "mean of W over tokens", "ratio", NEITHER),
            ("seq_is_std", "std", "population std of W over tokens", "ratio", LOWER),
            (
                "seq_is_fraction_low",
                "ratio_fraction_low",
                "fraction of every sequence with sum(delta) < log(1/C)",
                "fraction",
                LOWER,
            ),
        )
    ),
    *(
        MetricKey(
            name=f"seq_is_{stat}@C",
            definition=f"{stat} over every sequence of exp(sum(delta)), delta unclamped"
            + (" and the sum capped at 20" if stat == "max" else "")
            + ": the raw sequence-level weight before the cap C (an empty sequence's is 1)",
            unit="ratio",
            direction=NEITHER,
            group="verl",
            peers=_verl(f"rollout_is_{stat}", " (rollout_is: sequence, rollout_is_threshold: C)"),
        )
        for stat in ("max", "min")
    ),
    MetricKey(
        name="icepop_oob_fraction@C",
        definition="fraction of tokens with r < 1/C or r > C, delta clamped to [-20, 20]: the tokens IcePop with "
        "bounds [1/C, C] zeroes (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        peers=_verl("rollout_is_oob_ratio", ' (rollout_is: token, rollout_is_threshold: "1/C_C")'),
    ),
    MetricKey(
        name="seq_tis_clip_fraction@C",
        definition="fraction of every sequence with sum(delta) > log C: sequences whose sequence-level weight "
        "a cap C truncates (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        peers=_verl("rollout_is_ratio_fraction_high", " (rollout_is: sequence, rollout_is_threshold: C)"),
    ),
    *(
        MetricKey(
            name=f"{name}@MODE",
            definition=f"{definition} of verl's rejection statistic MODE: over a sequence's tokens the sum, mean or "
            "max of k1 = -delta, k2 = delta^2 / 2 or k3 = exp(delta) - 1 - delta, delta clamped to [-20, 20]",
            unit="nats",
            direction=NEITHER,
            group="verl",
            interval=interval,
            peers=_verl(f"rollout_rs_MODE_{verl}", " (rollout_rs: MODE)"),
            values=MODES,
        )
        for name, verl, definition, interval in (
            ("rs_mean", "mean", "token-weighted mean over sequences with a compared token", BOOTSTRAP),
            ("rs_seq_mean", "seq_mean", "mean over sequences with a compared token", BOOTSTRAP),
            ("rs_seq_std", "seq_std", "sample std (n - 1) over sequences with a compared token", BOOTSTRAP),
            ("rs_seq_max", "seq_max", "max over sequences with a compared token", NEITHER),
            ("rs_seq_min", "seq_min", "min over sequences with a compared token", NEITHER),
            (
                "rs_seq_max_deviation",
                "seq_max_deviation",
                "max of the absolute value over sequences with a compared token",
                NEITHER,
            ),
        )
    ),
    MetricKey(
        name="seq_geo_reject_fraction@T",
        definition="fraction of sequences with a compared token whose exp(abs(mean(delta))) > T, no clamp (--geo-bounds)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
        note="probe's own; verl 0.9.1 no longer has rollout_rs: geometric, its equivalent clamps delta per "
        "token: seq_mean_k1_reject_fraction@T",
    ),
    *(
        MetricKey(
            name=f"seq_{stat}_k1_reject_fraction@T",
            definition=f"fraction of sequences with a compared token whose {stat}(-delta), delta clamped to "
            "[-20, 20], is outside [log(1/T), log T] (--geo-bounds)",
            unit="fraction",
            direction=LOWER,
            group="threshold",
            interval=BOOTSTRAP,
            peers=_verl(
                f"rollout_rs_seq_{stat}_k1_seq_masked_fraction",
                f" (rollout_rs: seq_{stat}_k1, rollout_rs_threshold: T)",
            ),
        )
        for stat in ("mean", "sum")
    ),
)

# A policy comparison's own keys (report/policy/, docs/staleness.md): reference = the old pass (θ_old),
# candidate = a new policy's pass; per token a = ℓ_old − μ, s = ℓ_new − ℓ_old, t = a + s, b = ℓ_new − ℓ_new^N.
POLICY_NOTE = "policy comparisons only: reference = the θ_old score set, candidate = a new policy's pass"
RSPO = "RSPO (Towards Stable and Effective RL for MoE), eqs. 5-11"
CATALOGUE += (
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
        name="router_shift_clip_fraction@G",
        definition="fraction of tokens with γ < G (default G = 0.8, RSPO's γ_min)",
        unit="fraction",
        direction=LOWER,
        group="policy",
        interval=BOOTSTRAP,
        values=("0.8",),
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
            name=f"{prefix}_ratio_{side}_fraction@B",
            definition=f"fraction of tokens with {ratio} {'<' if side == 'below' else '>'} B (--ppo-bounds; "
            "below@0.8, above@1.2 and above@1.27 by default): an upper bound on the PPO clip fraction, "
            "with no advantages offline",
            unit="fraction",
            direction=LOWER,
            group="policy",
            interval=BOOTSTRAP,
            note=POLICY_NOTE
            + (f"; {RSPO}: the IS ratio rescaled by max(γ, γ_min) before clipping" if prefix == "rspo" else ""),
        )
        for prefix, ratio in (("ppo", "exp(s)"), ("rspo", "exp(s) max(γ, 0.8)"))
        for side in ("below", "above")
    ),
    MetricKey(
        name="total_tis_clip_fraction@C",
        definition="fraction of tokens with exp(t) > C, t = ℓ_new − μ (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="policy",
        interval=BOOTSTRAP,
        note=POLICY_NOTE,
    ),
)


def declared(key: str) -> MetricKey | None:
    """The declaration of a concrete key (`extreme_fraction@2` -> the extreme_fraction@T family), or None."""
    return next((entry for entry in CATALOGUE if entry.matches(key)), None)


def rank(key: str) -> tuple[int, int]:
    """Place of a key in the catalogue (a fixed family's values in their order); undeclared keys last."""
    for i, entry in enumerate(CATALOGUE):
        if entry.matches(key):
            return i, entry.names().index(key) if entry.values else 0
    return len(CATALOGUE), 0


def names(group: str | None = None) -> tuple[str, ...]:
    """Concrete keys declared (of one group), in catalogue order; user-parameter families have none."""
    return tuple(name for entry in CATALOGUE if group in (None, entry.group) for name in entry.names())


def checked(*keys: str) -> tuple[str, ...]:
    """`keys` after making sure each is declared: a presentation choice (columns shown by default) that
    names a key the report never writes is a bug to catch at import."""
    unknown = [key for key in keys if declared(key) is None]
    if unknown:
        raise ValueError(f"keys not in the catalogue: {', '.join(unknown)}")
    return keys
