"""The catalogue's third run: the correction what-ifs, under verl 0.9.1's names and definitions where a key
carries its name (the verl_correction accumulator computes those), and the sequence filters."""

from __future__ import annotations

from mismatch_probe.report.keys import families as fam
from mismatch_probe.report.keys.levels import MODES
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, HIGHER, LOWER, NEITHER, MetricKey, verl_peer

EVERY_SEQUENCE = "mean over every sequence (an empty response counts with a sequence mean of 0)"
# verl 0.9.1's token-level truncated IS (verl/trainer/ppo/rollout_corr_helper.py, compute_is_metrics)
VERL_TIS = " (rollout_is: token, rollout_is_threshold: C)"

CORRECTION_KEYS: tuple[MetricKey, ...] = (
    MetricKey(
        name="log_ppl_diff",
        definition=f"{EVERY_SEQUENCE} of -mean(delta)",
        unit="nats",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=verl_peer("log_ppl_diff"),
    ),
    *(
        MetricKey(
            name=f"log_ppl_diff_{stat}",
            definition=f"{stat} over every sequence of -mean(delta) (0 for an empty response)",
            unit="nats",
            direction=NEITHER,
            group="verl",
            peers=verl_peer(f"log_ppl_diff_{stat}"),
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
        peers=verl_peer("log_ppl_abs_diff"),
        gate_baseline=True,
    ),
    MetricKey(
        name="ppl_ratio",
        definition=f"{EVERY_SEQUENCE} of exp(-mean(delta))",
        unit="ratio",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=verl_peer("ppl_ratio"),
    ),
    *(
        MetricKey(
            name=f"{prefix}ppl_{side}",
            definition=f"{EVERY_SEQUENCE} of {exp_open}-mean(logprob_{side}){exp_close}",
            unit="nats" if prefix else "ratio",
            direction=NEITHER,
            group="verl",
            interval=BOOTSTRAP,
            peers=verl_peer(f"{verl_side}_{prefix}ppl"),
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
        peers=verl_peer("chi2_token"),
        gate_baseline=True,
    ),
    MetricKey(
        name="chi2_seq",
        definition=f"{EVERY_SEQUENCE} of exp(2 sum(delta)) - 1, the sum clamped to [-20, 20]",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=verl_peer("chi2_seq"),
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
            name=family.pattern,
            definition=f"{definition}; w = min(exp(delta clamped to [-20, 20]), C) (--tis-caps)",
            unit=unit,
            direction=direction,
            group="verl",
            interval=interval,
            peers=verl_peer(f"rollout_is_{verl}", VERL_TIS),
        )
        for family, verl, definition, unit, direction, interval in (
            (fam.IS_ESS, "eff_sample_size", "(sum w)^2 / (n sum w^2) over tokens", "fraction", HIGHER, BOOTSTRAP),
            (fam.IS_MEAN, "mean", "mean of w over tokens", "ratio", NEITHER, BOOTSTRAP),
            (fam.IS_STD, "std", "population std of w over tokens", "ratio", LOWER, BOOTSTRAP),
            (fam.IS_MIN, "min", "min of w over tokens", "ratio", NEITHER, NEITHER),
            (fam.IS_MAX, "max", "max of w over tokens", "ratio", NEITHER, NEITHER),
            (
                fam.IS_FRACTION_LOW,
                "ratio_fraction_low",
                "fraction of tokens with w < 1/C",
                "fraction",
                LOWER,
                BOOTSTRAP,
            ),
            (fam.IS_SEQ_MEAN, "seq_mean", f"{EVERY_SEQUENCE} of mean(w)", "ratio", NEITHER, BOOTSTRAP),
            (fam.IS_SEQ_STD, "seq_std", "sample std (n - 1) over every sequence of mean(w)", "ratio", LOWER, BOOTSTRAP),
            (fam.IS_SEQ_MIN, "seq_min", "min over every sequence of mean(w) (0 if empty)", "ratio", NEITHER, NEITHER),
            (fam.IS_SEQ_MAX, "seq_max", "max over every sequence of mean(w) (0 if empty)", "ratio", NEITHER, NEITHER),
            (
                fam.IS_SEQ_MAX_DEVIATION,
                "seq_max_deviation",
                "max over every sequence of abs(mean(w) - 1)",
                "ratio",
                LOWER,
                NEITHER,
            ),
            (
                fam.IS_SEQ_FRACTION_HIGH,
                "seq_fraction_high",
                "fraction of every sequence with mean(exp(delta clamped)) > C",
                "fraction",
                LOWER,
                BOOTSTRAP,
            ),
            (
                fam.IS_SEQ_FRACTION_LOW,
                "seq_fraction_low",
                "fraction of every sequence with mean(exp(delta clamped)) < 1/C (an empty one counts)",
                "fraction",
                LOWER,
                BOOTSTRAP,
            ),
        )
    ),
    MetricKey(
        name=fam.TIS_CLIP_FRACTION.pattern,
        definition="fraction of tokens with r > C, delta clamped to [-20, 20] (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
        peers=verl_peer("rollout_is_ratio_fraction_high", VERL_TIS),
        note="slime/miles tis_clipfrac also counts the tokens below its lower clip",
    ),
    *(
        MetricKey(
            name=family.pattern,
            definition=f"{definition}; W = min(exp(sum(delta) clamped to [-20, 20]), C), one weight per sequence "
            "(--tis-caps)",
            unit=unit,
            direction=direction,
            group="verl",
            interval=BOOTSTRAP,
            peers=verl_peer(f"rollout_is_{verl}", " (rollout_is: sequence, rollout_is_threshold: C)"),
        )
        for family, verl, definition, unit, direction in (
            (
                fam.SEQ_IS_ESS,
                "eff_sample_size",
                "(sum n W)^2 / (N sum n W^2), n a sequence's tokens",
                "fraction",
                HIGHER,
            ),
            (fam.SEQ_IS_MEAN, "mean", "mean of W over tokens", "ratio", NEITHER),
            (fam.SEQ_IS_STD, "std", "population std of W over tokens", "ratio", LOWER),
            (
                fam.SEQ_IS_FRACTION_LOW,
                "ratio_fraction_low",
                "fraction of every sequence with sum(delta) < log(1/C)",
                "fraction",
                LOWER,
            ),
        )
    ),
    *(
        MetricKey(
            name=family.pattern,
            definition=f"{stat} over every sequence of exp(sum(delta)), delta unclamped"
            + (" and the sum capped at 20" if stat == "max" else "")
            + ": the raw sequence-level weight before the cap C (an empty sequence's is 1)",
            unit="ratio",
            direction=NEITHER,
            group="verl",
            peers=verl_peer(f"rollout_is_{stat}", " (rollout_is: sequence, rollout_is_threshold: C)"),
        )
        for stat, family in (("max", fam.SEQ_IS_MAX), ("min", fam.SEQ_IS_MIN))
    ),
    MetricKey(
        name=fam.ICEPOP_OOB_FRACTION.pattern,
        definition="fraction of tokens with r < 1/C or r > C, delta clamped to [-20, 20]: the tokens IcePop with "
        "bounds [1/C, C] zeroes (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        peers=verl_peer("rollout_is_oob_ratio", ' (rollout_is: token, rollout_is_threshold: "1/C_C")'),
    ),
    MetricKey(
        name=fam.SEQ_TIS_CLIP_FRACTION.pattern,
        definition="fraction of every sequence with sum(delta) > log C: sequences whose sequence-level weight "
        "a cap C truncates (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        peers=verl_peer("rollout_is_ratio_fraction_high", " (rollout_is: sequence, rollout_is_threshold: C)"),
    ),
    *(
        MetricKey(
            name=family.pattern,
            definition=f"{definition} of verl's rejection statistic MODE: over a sequence's tokens the sum, mean or "
            "max of k1 = -delta, k2 = delta^2 / 2 or k3 = exp(delta) - 1 - delta, delta clamped to [-20, 20]",
            unit="nats",
            direction=NEITHER,
            group="verl",
            interval=interval,
            peers=verl_peer(f"rollout_rs_MODE_{verl}", " (rollout_rs: MODE)"),
            values=MODES,
        )
        for family, verl, definition, interval in (
            (fam.RS_MEAN, "mean", "token-weighted mean over sequences with a compared token", BOOTSTRAP),
            (fam.RS_SEQ_MEAN, "seq_mean", "mean over sequences with a compared token", BOOTSTRAP),
            (fam.RS_SEQ_STD, "seq_std", "sample std (n - 1) over sequences with a compared token", BOOTSTRAP),
            (fam.RS_SEQ_MAX, "seq_max", "max over sequences with a compared token", NEITHER),
            (fam.RS_SEQ_MIN, "seq_min", "min over sequences with a compared token", NEITHER),
            (
                fam.RS_SEQ_MAX_DEVIATION,
                "seq_max_deviation",
                "max of the absolute value over sequences with a compared token",
                NEITHER,
            ),
        )
    ),
    MetricKey(
        name=fam.SEQ_GEO_REJECT_FRACTION.pattern,
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
            name=family.pattern,
            definition=f"fraction of sequences with a compared token whose {stat}(-delta), delta clamped to "
            "[-20, 20], is outside [log(1/T), log T] (--geo-bounds)",
            unit="fraction",
            direction=LOWER,
            group="threshold",
            interval=BOOTSTRAP,
            peers=verl_peer(
                f"rollout_rs_seq_{stat}_k1_seq_masked_fraction",
                f" (rollout_rs: seq_{stat}_k1, rollout_rs_threshold: T)",
            ),
        )
        for stat, family in (("mean", fam.SEQ_MEAN_K1_REJECT_FRACTION), ("sum", fam.SEQ_SUM_K1_REJECT_FRACTION))
    ),
)
