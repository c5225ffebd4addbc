"""Which temperature each side's log-probs were taken at, from what the token table holds.

The gap between the top-1 and the sampled token's log-prob on one side is (z_top - z_tok) / T, so the
ratio of the two sides' gaps is the ratio of their temperatures whatever the logits. Which side is off
is told by calibration: a side at the sampling temperature has a mean top-1 probability equal to the rate
at which the sampled token is its top-1.
"""

from __future__ import annotations

import math

# The gap ratio is 0.9996-1.0001 on clean comparisons and 0.5 or 2 for T=1 against T=2; 25% off
# is far from both. Clean top-1 calibration sits within 0.4 standard errors; a side at T=1 is 12 off.
TEMPERATURE_RATIO = 1.25
CALIBRATION_Z = 4.0  # a side whose top-1 calibration is off by this many standard errors
RAW_TOLERANCE = 1.1  # a fitted temperature within 10% of 1: that side's log-probs are raw logits


def calibration(s: dict, side: str, min_tokens: int) -> dict | None:
    """A side's top-1 calibration from PairStats sums; None on too few tokens."""
    n = s.get(f"cal_n_{side}", 0)
    if n < min_tokens:
        return None
    p, hit, var = s[f"cal_p_{side}"] / n, s[f"cal_hit_{side}"] / n, s[f"cal_var_{side}"]
    se = math.sqrt(max(var, 1e-12)) / n
    return {"mean_top1_prob": round(p, 4), "top1_sampled_rate": round(hit, 4), "z": round((p - hit) / se, 2)}


def culprit(cal: dict, ratio: float, recorded: float) -> str:
    """Which side ("ref" or "cand") is off the recorded temperature, when their gap ratio says one is.
    First, the side whose probabilities do not match the rate at which its sampled tokens are its top-1
    (decisive on peaked models). Else the side that would sit at T = 1: raw, unscaled logits are the
    usual bug on either side. Else the training side (the candidate of a rollout comparison)."""
    z = {side: abs(c["z"]) if c else 0.0 for side, c in cal.items()}
    for side, other in (("ref", "cand"), ("cand", "ref")):
        if z[side] > max(z[other], CALIBRATION_Z):
            return side
    fits = {"ref": recorded / ratio, "cand": recorded * ratio}  # each side's temperature if it is the one off
    for side in ("ref", "cand"):
        if abs(math.log(fits[side])) < math.log(RAW_TOLERANCE):
            return side
    return "cand"
