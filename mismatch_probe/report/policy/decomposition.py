"""The IS log-ratio of a new policy's token split into its factors (the formulation paper's eq. 5):
t = a + s with a = ℓ_old − μ (training–inference) and s = ℓ_new − ℓ_old (staleness), and b = ℓ_new − ℓ_new^N,
the bias a replay adds. Means over tokens, each with a bootstrap interval over sequences; the variances are
population variances over tokens, so Var(t) = Var(a) + Var(s) + 2 Cov(a, s) holds to rounding."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mismatch_probe.report.keys.families import PPO_RATIO_FRACTION, TOTAL_TIS_CLIP_FRACTION
from mismatch_probe.report.keys.levels import DEFAULT_PPO_BOUNDS, DEFAULT_TIS_CAPS
from mismatch_probe.report.policy.tokens import PolicyTokens
from mismatch_probe.report.policy.totals import Totals


def k3(x: np.ndarray) -> np.ndarray:
    return np.expm1(x) - x


def _mean(col: str):
    return lambda t: t[col] / t["n"]


def _var(x: str, y: str, xy: str):
    return lambda t: t[xy] / t["n"] - (t[x] / t["n"]) * (t[y] / t["n"])


@dataclass
class Decomposition:
    ppo_bounds: tuple[tuple[str, str], ...] = DEFAULT_PPO_BOUNDS
    tis_caps: tuple = DEFAULT_TIS_CAPS
    totals: Totals = field(default=None)
    bias: Totals = field(default=None)  # over the tokens where N is read (all of them, when N exists)

    def __post_init__(self):
        if self.totals is None:
            columns = ["n", "k3_a", "k3_t", "a", "s", "t", "aa", "ss", "as", "tt"]
            columns += [f"ppo{i}" for i in range(len(self.ppo_bounds))]
            columns += [f"tis{i}" for i in range(len(self.tis_caps))]
            self.totals = Totals(columns=tuple(columns))
            self.bias = Totals(columns=("n", "k3_b", "b"))

    def update(self, tokens: PolicyTokens) -> None:
        a, s = tokens.a, tokens.s
        t = a + s
        values = {"n": np.ones_like(a), "k3_a": k3(a), "k3_t": k3(t), "a": a, "s": s, "t": t}
        values |= {"aa": a * a, "ss": s * s, "as": a * s, "tt": t * t}
        for i, (side, bound) in enumerate(self.ppo_bounds):
            values[f"ppo{i}"] = s < np.log(float(bound)) if side == "below" else s > np.log(float(bound))
        for i, cap in enumerate(self.tis_caps):
            values[f"tis{i}"] = t > np.log(float(cap))
        rows = tokens.frame.rows
        self.totals.add(rows, tokens.segment, values)
        if tokens.b is not None:
            self.bias.add(rows, tokens.segment, {"n": np.ones_like(a), "k3_b": k3(tokens.b), "b": tokens.b})

    def merge(self, other: Decomposition) -> None:
        self.totals.merge(other.totals)
        self.bias.merge(other.bias)

    def finish(self, has_natural: bool) -> dict:
        self.totals.close()
        self.bias.close()
        formulas = {
            "tid_k3_kl": _mean("k3_a"),
            "total_k3_kl": _mean("k3_t"),
            "tid_log_ratio_var": _var("a", "a", "aa"),
            "stale_log_ratio_var": _var("s", "s", "ss"),
            "tid_stale_log_ratio_cov": _var("a", "s", "as"),
            "total_log_ratio_var": _var("t", "t", "tt"),
        }
        formulas |= {PPO_RATIO_FRACTION[side].at(b): _mean(f"ppo{i}") for i, (side, b) in enumerate(self.ppo_bounds)}
        formulas |= {TOTAL_TIS_CLIP_FRACTION.at(cap): _mean(f"tis{i}") for i, cap in enumerate(self.tis_caps)}
        out = {"n_policy_tokens": int(self.totals.totals[0])} | self.totals.metrics(formulas)
        bias = self.bias.metrics({"replay_bias_k3_kl": _mean("k3_b"), "replay_bias_mean": _mean("b")})
        if not has_natural:
            bias = dict.fromkeys(bias)
        return out | bias
