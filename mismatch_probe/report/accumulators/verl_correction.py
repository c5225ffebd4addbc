"""The numbers verl 0.9.1's rollout correction logs, under verl's definitions: its ±20 clamp, its caps, and its
averaging over every sequence (an empty response counts, with a per-sequence mean of 0).

Definitions from verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py (the package on PyPI):
`compute_offpolicy_metrics` (line 904: ppl, log_ppl_diff, ppl_ratio, chi2), `compute_is_metrics` (line 660:
token-level TIS weights, their ESS and sequence means), `compute_rollout_correction_weights` (line 522:
sequence-level weights), `compute_rollout_rejection_mask` (line 197: seq_mean_k1) and SAFETY_BOUND (line 75). Their masked means add
1e-8 to the token count (a guard against empty masks); these do not: the difference is 1e-8 relative per token.

Here `delta` is verl's log_ratio (candidate - reference: training - rollout when the reference is the
rollout), `safe` is delta clamped to ±SAFETY_BOUND, and C is a --tis-caps cap, T a --geo-bounds bound.
Every column is a sum over a sequence's compared tokens (`token_values`) or a value per sequence
(`sequence_values`), so SequenceStats gives each an exact merge and a bootstrap interval; the maxima and
minima over tokens or sequences (`token_extrema`, `sequence_extrema`) merge by max/min and have no interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mismatch_probe.report.keys import families as fam
from mismatch_probe.report.keys.levels import MODES

SAFETY_BOUND = 20.0  # verl's SAFETY_BOUND: log-ratios are clamped here before exp
MAXIMA = ("max_safe", "neg_min_safe")  # per-sequence maxima carried for seq_max_k2/k3


def token_values(delta: np.ndarray, caps: list[float]) -> tuple[list[np.ndarray], list[str]]:
    """Per compared token: (values, their column names) to be summed per sequence."""
    safe = np.clip(delta, -SAFETY_BOUND, SAFETY_BOUND)
    raw = np.exp(safe)  # verl's raw_rollout_is_weights (token level)
    values = [safe, raw, np.exp(np.abs(delta)), 0.5 * safe * safe, np.expm1(safe) - safe]
    names = ["safe", "raw_w", "mult_prob", "k2_safe", "k3_safe"]
    for i, cap in enumerate(caps):
        w = np.minimum(raw, cap)  # TIS: clamp(max=C)
        # std from sums about 1, where the weights are: the same number as verl's E[w^2] - E[w]^2, without
        # the cancellation that makes that difference depend on the order of summation (and so on merging)
        values += [w, w * w, raw < 1.0 / cap, w - 1.0, (w - 1.0) ** 2]
        names += [f"w{i}", f"w2{i}", f"w_low{i}", f"w_dev{i}", f"w_dev2{i}"]
    return values, names


def token_maxima(delta: np.ndarray) -> np.ndarray:
    """[MAXIMA, tokens]: what per-sequence maxima are taken of."""
    safe = np.clip(delta, -SAFETY_BOUND, SAFETY_BOUND)
    return np.array([safe, -safe])


def mode_statistics(sums: dict[str, np.ndarray], maxima: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each rejection mode's statistic per sequence (0 for an empty one, which verl leaves out of these)."""
    n = sums["n"]
    has = n > 0
    k1_sum, k2_sum, k3_sum = -sums["safe"], sums["k2_safe"], sums["k3_safe"]
    high = np.where(has, maxima["max_safe"], 0.0)
    low = np.where(has, -maxima["neg_min_safe"], 0.0)
    k3 = lambda x: np.expm1(x) - x  # noqa: E731 (convex, least at 0: its max over tokens is at the max or min)
    out = {"seq_sum_k1": k1_sum, "seq_sum_k2": k2_sum, "seq_sum_k3": k3_sum}
    out |= {mode.replace("sum", "mean"): np.divide(v, n, out=np.zeros_like(n), where=has) for mode, v in out.items()}
    out["seq_max_k2"] = 0.5 * np.maximum(high * high, low * low)
    out["seq_max_k3"] = np.maximum(k3(high), k3(low))
    return {mode: out[mode] for mode in MODES}


def sequence_values(
    sums: dict[str, np.ndarray], maxima: dict[str, np.ndarray], caps: list[float], bounds: list[float]
) -> tuple[list, list]:
    """Per sequence, from its token sums and maxima (by name, [k]): (values, names). Every sequence is a verl row."""
    n = sums["n"]
    has = n > 0
    seq_mean = lambda total: np.divide(total, n, out=np.zeros_like(n), where=has)  # noqa: E731 (verl: 0 if empty)
    mean_lp_ref, mean_lp_cand = seq_mean(sums["lp_ref"]), seq_mean(sums["lp_cand"])
    values = [np.ones_like(n), np.exp(-mean_lp_ref), np.exp(-mean_lp_cand), -mean_lp_ref, -mean_lp_cand]
    names = ["rows", "ppl_ref", "ppl_cand", "log_ppl_ref", "log_ppl_cand"]
    mean_w_raw = seq_mean(sums["raw_w"])
    for i, cap in enumerate(caps):
        x = seq_mean(sums[f"w{i}"])
        values += [x, x - 1.0, (x - 1.0) ** 2, mean_w_raw > cap, mean_w_raw < 1.0 / cap, sums["delta"] > math.log(cap)]
        names += [f"seq_w{i}", f"seq_dev{i}", f"seq_dev2{i}", f"seq_high{i}", f"seq_low{i}", f"seq_tis{i}"]
        # rollout_is: sequence: one weight per sequence, min(exp(clamped sum of delta), C), on each of its tokens
        weight = np.minimum(np.exp(np.clip(sums["delta"], -SAFETY_BOUND, SAFETY_BOUND)), cap)
        values += [n * weight, n * weight * weight, n * (weight - 1.0), n * (weight - 1.0) ** 2]
        values.append(sums["delta"] < math.log(1.0 / cap))
        names += [f"sis{i}", f"sis2{i}", f"sis_dev{i}", f"sis_dev2{i}", f"sis_low{i}"]
    modes = mode_statistics(sums, maxima)
    for mode, stat in modes.items():
        stat = stat * has
        values += [stat, stat * stat, n * stat]
        names += [f"rs_{mode}", f"rs2_{mode}", f"rs_tok_{mode}"]
    for j, bound in enumerate(bounds):  # kept where log(1/T) <= k1 <= log(T); empty sequences are not counted
        for mode in ("seq_mean_k1", "seq_sum_k1"):
            k1 = modes[mode]
            values.append(has & ((k1 < math.log(1.0 / bound)) | (k1 > math.log(bound))))
            names.append(f"{mode}_reject{j}")
    return values, names


def formulas(c: dict[str, int], caps, bounds) -> dict[str, Callable]:
    """Each key as a function of the totals (or of [columns, resamples] weighted totals)."""

    def mean(col: str, den: str) -> Callable:
        return lambda t: t[c[col]] / t[c[den]]

    out = {
        "ppl_ref": mean("ppl_ref", "rows"),
        "ppl_cand": mean("ppl_cand", "rows"),
        "log_ppl_ref": mean("log_ppl_ref", "rows"),
        "log_ppl_cand": mean("log_ppl_cand", "rows"),
        "mult_prob_error": mean("mult_prob", "n"),
    }
    for i, cap in enumerate(caps):
        w, w2, dev, dev2, n, rows = c[f"w{i}"], c[f"w2{i}"], c[f"w_dev{i}"], c[f"w_dev2{i}"], c["n"], c["rows"]
        sdev, sdev2 = c[f"seq_dev{i}"], c[f"seq_dev2{i}"]
        out |= {
            fam.IS_ESS.at(cap): lambda t, w=w, w2=w2, n=n: t[w] ** 2 / (t[n] * t[w2]),
            fam.IS_MEAN.at(cap): mean(f"w{i}", "n"),
            fam.IS_STD.at(cap): lambda t, d=dev, d2=dev2, n=n: _std(t[d], t[d2], t[n]),
            fam.IS_FRACTION_LOW.at(cap): mean(f"w_low{i}", "n"),
            # IcePop with bounds [1/C, C]: the tokens it zeroes, below 1/C or above C
            fam.ICEPOP_OOB_FRACTION.at(cap): lambda t, low=c[f"w_low{i}"], high=c[f"tis{i}"], n=n: (
                (t[low] + t[high]) / t[n]
            ),
            fam.IS_SEQ_MEAN.at(cap): mean(f"seq_w{i}", "rows"),
            fam.IS_SEQ_STD.at(cap): lambda t, s=sdev, s2=sdev2, m=rows: _sample_std(t[s], t[s2], t[m]),
            fam.IS_SEQ_FRACTION_HIGH.at(cap): mean(f"seq_high{i}", "rows"),
            fam.IS_SEQ_FRACTION_LOW.at(cap): mean(f"seq_low{i}", "rows"),
            fam.SEQ_TIS_CLIP_FRACTION.at(cap): mean(f"seq_tis{i}", "rows"),
            fam.SEQ_IS_MEAN.at(cap): mean(f"sis{i}", "n"),
            fam.SEQ_IS_STD.at(cap): lambda t, d=c[f"sis_dev{i}"], d2=c[f"sis_dev2{i}"], n=n: _std(t[d], t[d2], t[n]),
            fam.SEQ_IS_ESS.at(cap): lambda t, w=c[f"sis{i}"], w2=c[f"sis2{i}"], n=n: t[w] ** 2 / (t[n] * t[w2]),
            fam.SEQ_IS_FRACTION_LOW.at(cap): mean(f"sis_low{i}", "rows"),
        }
    for j, bound in enumerate(bounds):  # verl divides by the sequences with a token
        for mode, family in (
            ("seq_mean_k1", fam.SEQ_MEAN_K1_REJECT_FRACTION),
            ("seq_sum_k1", fam.SEQ_SUM_K1_REJECT_FRACTION),
        ):
            out[family.at(bound)] = mean(f"{mode}_reject{j}", "has")
    for mode in MODES:  # verl: rollout_rs_MODE_mean weights each sequence by its tokens; _seq_* do not
        rs, rs2, has = c[f"rs_{mode}"], c[f"rs2_{mode}"], c["has"]
        out[fam.RS_MEAN.at(mode)] = mean(f"rs_tok_{mode}", "n")
        out[fam.RS_SEQ_MEAN.at(mode)] = mean(f"rs_{mode}", "has")
        out[fam.RS_SEQ_STD.at(mode)] = lambda t, s=rs, s2=rs2, m=has: _sample_std(t[s], t[s2], t[m])
    return out


def _std(total, squares, count):
    """Population std from sums (about 1, see token_values)."""
    return np.sqrt(np.maximum(squares / count - (total / count) ** 2, 0.0))


def _sample_std(total, squares, count):
    """torch's std (n - 1 in the denominator); verl logs 0 for a single sequence."""
    var = (squares - total * total / count) / (count - 1)
    return np.where(count > 1, np.sqrt(np.maximum(var, 0.0)), 0.0)


def token_extrema(token: dict[str, np.ndarray], n_caps: int) -> tuple[dict, dict]:
    """(maxima, minima) over one chunk's compared tokens: the TIS weights' max and min per cap. `token` holds
    token_values by name, so the weights are not computed again."""
    weights = [token[f"w{i}"] for i in range(n_caps)]
    if len(token["safe"]) == 0:
        return {}, {}
    return {f"is_max{i}": float(w.max()) for i, w in enumerate(weights)}, {
        f"is_min{i}": float(w.min()) for i, w in enumerate(weights)
    }


def sequence_extrema(seq: dict[str, np.ndarray], caps: list[float]) -> tuple[dict, dict]:
    """(maxima, minima) over complete sequences: `seq` holds sequence_values by name, `neg_mean_delta`,
    `sum_delta` (unclamped) and `has` (a compared token)."""
    if len(seq["rows"]) == 0:
        return {}, {}
    has = seq["has"]
    maxima = {"log_ppl_diff_max": float(seq["neg_mean_delta"].max())}
    minima = {"log_ppl_diff_min": float(seq["neg_mean_delta"].min())}
    for i in range(len(caps)):
        x = seq[f"seq_w{i}"]
        maxima[f"is_seq_max{i}"], minima[f"is_seq_min{i}"] = float(x.max()), float(x.min())
        maxima[f"is_seq_max_deviation{i}"] = float(np.abs(x - 1.0).max())
        # rollout_is: sequence logs the raw weight's extremes over every row: exp of the sum of unclamped delta,
        # the max capped at exp(20), not at C (an empty row's sum is 0)
        maxima[f"seq_is_max{i}"] = float(np.exp(min(float(seq["sum_delta"].max()), SAFETY_BOUND)))
        minima[f"seq_is_min{i}"] = float(np.exp(float(seq["sum_delta"].min())))
    if has.any():  # the rejection statistics are over sequences with a token
        for mode in MODES:
            stat = seq[f"rs_{mode}"][has]
            maxima[f"rs_seq_max_{mode}"], minima[f"rs_seq_min_{mode}"] = float(stat.max()), float(stat.min())
            maxima[f"rs_seq_max_deviation_{mode}"] = float(np.abs(stat).max())  # verl: deviation from 0
    return maxima, minima


def extrema_keys(caps) -> dict[str, str]:
    """Metric key of each extremum's internal name."""
    out = {"log_ppl_diff_max": "log_ppl_diff_max", "log_ppl_diff_min": "log_ppl_diff_min"}
    for i, cap in enumerate(caps):
        for name, family in (
            ("is_max", fam.IS_MAX),
            ("is_min", fam.IS_MIN),
            ("is_seq_max", fam.IS_SEQ_MAX),
            ("is_seq_min", fam.IS_SEQ_MIN),
            ("is_seq_max_deviation", fam.IS_SEQ_MAX_DEVIATION),
            ("seq_is_max", fam.SEQ_IS_MAX),
            ("seq_is_min", fam.SEQ_IS_MIN),
        ):
            out[f"{name}{i}"] = family.at(cap)
    for mode in MODES:
        out[f"rs_seq_max_{mode}"], out[f"rs_seq_min_{mode}"] = fam.RS_SEQ_MAX.at(mode), fam.RS_SEQ_MIN.at(mode)
        out[f"rs_seq_max_deviation_{mode}"] = fam.RS_SEQ_MAX_DEVIATION.at(mode)
    return out
