"""Correction what-ifs (the numbers verl and slime log for TIS, rejection and ESS) and the 95% intervals
of every headline metric, from per-sequence sums in one streaming pass.

Each chunk's aligned rows are reduced to one column of sums per sequence (np.bincount over a
per-row sequence index). The last sequence of a chunk may continue in the next chunk, so it is
carried over and only complete sequences are used: sequence-level keys (log_ppl_diff, chi2_seq,
the geometric filter) are non-linear in a sequence's tokens. Complete sequences then feed plain
totals (point estimates) and Poisson-bootstrap weighted totals (intervals); see bootstrap.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .bootstrap import RESAMPLES, SEED, interval, poisson_weights
from .errors import ProbeError
from .metrics import DEFAULT_THRESHOLDS, extreme_key, threshold_label

DEFAULT_TIS_CAPS = (2, 5)
DEFAULT_GEO_BOUNDS = (1.001, 1.01)
CORRECTION_KEYS = ("log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "chi2_token", "chi2_seq", "is_ess")
LEVEL_PREFIXES = ("tis_clip_fraction@", "seq_geo_reject_fraction@")
CHI2_CLAMP = 20.0  # |delta| (or a sequence's sum of delta) is clamped here before exp(2 x) in chi2
ROUTING_SPLITS = ("routing_same", "routing_diff")  # tokens whose expert sets agree in every MoE layer / not


def tis_key(cap) -> str:
    return f"tis_clip_fraction@{threshold_label(cap)}"


def geo_key(bound) -> str:
    return f"seq_geo_reject_fraction@{threshold_label(bound)}"


def parse_levels(values, option: str, valid: Callable[[float], bool], requirement: str, example: str) -> tuple[str, ...]:
    """Thresholds, caps or bounds as the user spelled them (the spelling is the key suffix)."""
    labels = []
    for value in values:
        label = threshold_label(value)
        try:
            level = float(label)
        except ValueError:
            raise ProbeError(f"{option}: {label!r} is not a number") from None
        if not math.isfinite(level) or not valid(level):
            raise ProbeError(f"{option}: {label} must be a finite number {requirement}")
        if label not in labels:
            labels.append(label)
    if not labels:
        raise ProbeError(f"{option}: expected at least one value, e.g. {example}")
    return tuple(labels)


def parse_caps(values) -> tuple[str, ...]:
    return parse_levels(values, "--tis-caps", lambda c: c > 0, "> 0, e.g. 2,5", "2,5")


def parse_bounds(values) -> tuple[str, ...]:
    return parse_levels(values, "--geo-bounds", lambda b: b > 1, "> 1, e.g. 1.001,1.01", "1.001,1.01")


def _ratio(num: int, den: int, scale: float = 1.0) -> Callable:
    return lambda t: t[num] / (t[den] * scale)


@dataclass
class SequenceStats:
    """Per-comparison accumulator: correction what-ifs and the intervals of every headline key."""

    thresholds: tuple = DEFAULT_THRESHOLDS
    tis_caps: tuple = DEFAULT_TIS_CAPS
    geo_bounds: tuple = DEFAULT_GEO_BOUNDS
    num_layers: int = 0  # 0: no routing intervals (dense model)
    resamples: int = RESAMPLES
    seed: int = SEED
    totals: np.ndarray = field(default=None)
    resampled: np.ndarray = field(default=None)  # [columns, resamples] weighted totals
    carry_id: int | None = None
    carry: np.ndarray | None = None  # token-level sums of the sequence that may continue

    def __post_init__(self):
        names = ["n", "k3", "k1", "k2", "abs_delta", "delta", "r", "r2", "chi2_token"]
        names += [f"extreme{i}" for i in range(len(self.thresholds))]
        names += [f"tis{i}" for i in range(len(self.tis_caps))]
        names += ["routed", "layers_differing", "tokens_differing"]
        names += [f"{stat}@{split}" for split in ROUTING_SPLITS for stat in ("n", "k3")]
        self.token_columns = len(names)
        names += ["has", "neg_mean_delta", "abs_mean_delta", "exp_neg_mean_delta", "chi2_seq"]
        names += [f"geo{i}" for i in range(len(self.geo_bounds))]
        self.column = {name: i for i, name in enumerate(names)}
        self.totals = np.zeros(len(names))
        self.resampled = np.zeros((len(names), self.resamples))
        self.caps = [float(cap) for cap in self.tis_caps]
        self.bounds = [float(bound) for bound in self.geo_bounds]
        self.limits = [float(t) for t in self.thresholds]
        self.formulas = self._formulas()

    def _formulas(self) -> dict[str, Callable]:
        """Every key as a function of the totals; the same function gives each resample's value."""
        c = self.column
        keys = {name: _ratio(c[col], c["n"]) for name, col in (
            ("k3_kl", "k3"), ("k1_kl", "k1"), ("k2_kl", "k2"), ("abs_logprob_diff_mean", "abs_delta"))}  # fmt: skip
        keys |= {extreme_key(t): _ratio(c[f"extreme{i}"], c["n"]) for i, t in enumerate(self.thresholds)}
        if self.num_layers:
            keys["router_diff_rate"] = _ratio(c["layers_differing"], c["routed"], self.num_layers)
            keys["token_diff_rate"] = _ratio(c["tokens_differing"], c["routed"])
            keys |= {f"k3_kl@{split}": _ratio(c[f"k3@{split}"], c[f"n@{split}"]) for split in ROUTING_SPLITS}
        keys |= {name: _ratio(c[col], c["has"]) for name, col in (
            ("log_ppl_diff", "neg_mean_delta"), ("log_ppl_abs_diff", "abs_mean_delta"),
            ("ppl_ratio", "exp_neg_mean_delta"))}  # fmt: skip
        keys["chi2_token"] = _ratio(c["chi2_token"], c["n"])
        keys["chi2_seq"] = _ratio(c["chi2_seq"], c["has"])
        keys["is_ess"] = lambda t: t[c["r"]] ** 2 / (t[c["n"]] * t[c["r2"]])
        keys |= {tis_key(cap): _ratio(c[f"tis{i}"], c["n"]) for i, cap in enumerate(self.tis_caps)}
        keys |= {geo_key(b): _ratio(c[f"geo{i}"], c["has"]) for i, b in enumerate(self.geo_bounds)}
        return keys

    def update(self, sample_id, use, lp_ref, lp_cand, routed=None) -> None:
        """use: [n] rows with finite log-probs on both sides; routed: (rows, layers differing per row) or None."""
        if len(sample_id) == 0:
            return
        starts = np.flatnonzero(sample_id[1:] != sample_id[:-1]) + 1
        index = np.zeros(len(sample_id), dtype=np.int64)
        index[starts] = 1
        np.cumsum(index, out=index)
        ids = sample_id[np.concatenate([[0], starts])].astype(np.int64)
        sums = self._token_sums(index, len(ids), use, lp_ref, lp_cand, routed)
        if self.carry_id is not None and self.carry_id == ids[0]:
            sums[:, 0] += self.carry
        elif self.carry_id is not None:
            self._add_sequences(np.array([self.carry_id]), self.carry[:, None])
        self._add_sequences(ids[:-1], sums[:, :-1])
        self.carry_id, self.carry = int(ids[-1]), sums[:, -1].copy()

    def finish(self) -> None:
        if self.carry_id is not None:
            self._add_sequences(np.array([self.carry_id]), self.carry[:, None])
            self.carry_id = self.carry = None

    def _token_sums(self, index, m, use, lp_ref, lp_cand, routed) -> np.ndarray:
        sums = np.zeros((self.token_columns, m))
        delta = lp_cand[use].astype(np.float64) - lp_ref[use].astype(np.float64)
        abs_delta, r = np.abs(delta), np.exp(delta)
        clamped = np.clip(delta, -CHI2_CLAMP, CHI2_CLAMP)
        values = [np.ones_like(delta), np.expm1(delta) - delta, -delta, 0.5 * delta * delta, abs_delta, delta,
                  r, r * r, np.expm1(2.0 * clamped)]  # fmt: skip
        ratio_max = np.exp(abs_delta)  # max(r, 1/r)
        values += [(ratio_max > t).astype(np.float64) for t in self.limits]
        values += [(r > cap).astype(np.float64) for cap in self.caps]
        at = index[use]
        for row, value in enumerate(values):
            sums[row] = np.bincount(at, weights=value, minlength=m)
        if routed is not None:
            self._routing_sums(sums, index, m, use, values[1], routed)
        return sums

    def _routing_sums(self, sums, index, m, use, k3, routed) -> None:
        """Routed rows and their differing layers; k3 split by whether any layer's expert set differs."""
        rows, layers_differing = routed.rows, routed.layers_differing
        at = index[rows]
        c = self.column
        sums[c["routed"]] = np.bincount(at, minlength=m)
        sums[c["layers_differing"]] = np.bincount(at, weights=layers_differing[rows], minlength=m)
        differs = layers_differing > 0
        sums[c["tokens_differing"]] = np.bincount(at, weights=differs[rows].astype(np.float64), minlength=m)
        used_rows, used_differs = rows[use], differs[use]  # aligned with k3, which covers the `use` rows
        at = index[use]
        for split, keep in zip(ROUTING_SPLITS, (used_rows & ~used_differs, used_rows & used_differs)):
            sums[c[f"n@{split}"]] = np.bincount(at[keep], minlength=m)
            sums[c[f"k3@{split}"]] = np.bincount(at[keep], weights=k3[keep], minlength=m)

    def _add_sequences(self, ids: np.ndarray, token_sums: np.ndarray) -> None:
        if len(ids) == 0:
            return
        c = self.column
        n = token_sums[c["n"]]
        has = n > 0
        mean_delta = np.divide(token_sums[c["delta"]], n, out=np.zeros_like(n), where=has)
        seq_sum = np.clip(token_sums[c["delta"]], -CHI2_CLAMP, CHI2_CLAMP)
        seq = [has.astype(np.float64), -mean_delta, np.abs(mean_delta), np.exp(-mean_delta) * has,
               np.expm1(2.0 * seq_sum) * has]  # fmt: skip
        geo_ratio = np.exp(np.abs(mean_delta))
        seq += [(geo_ratio > bound) & has for bound in self.bounds]
        columns = np.vstack([token_sums, np.array(seq, dtype=np.float64)])
        self.totals += columns.sum(axis=1)
        self.resampled += columns @ poisson_weights(ids, self.seed, self.resamples)

    def result(self, point_values: dict) -> tuple[dict, dict]:
        """(new keys with their values, {key: [low, high]} for every key with an interval).
        `point_values` are the headline values computed elsewhere, for the intervals to contain them."""
        values, intervals = self._routing_split_counts(), {}
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for key, formula in self.formulas.items():
                point = formula(self.totals)
                point = float(point) if np.isfinite(point) else None
                if key not in point_values:
                    values[key] = point
                intervals[key] = interval(formula(self.resampled), point_values.get(key, point))
        if values[f"n_tokens@{ROUTING_SPLITS[0]}"] is None:  # dense, or no position routed on both sides
            values |= {f"k3_kl@{split}": None for split in ROUTING_SPLITS}
            intervals |= {f"k3_kl@{split}": None for split in ROUTING_SPLITS}
        return values, intervals

    def _routing_split_counts(self) -> dict:
        routed = self.num_layers and self.totals[self.column["routed"]] > 0
        return {f"n_tokens@{split}": int(self.totals[self.column[f"n@{split}"]]) if routed else None
                for split in ROUTING_SPLITS}  # fmt: skip
    def resampled_values(self, key: str) -> np.ndarray:
        """[resamples] values of `key` in each bootstrap resample. The weights depend only on (seed, sample_id,
        resample), so two comparisons over the same sequences line up resample by resample (paired bootstrap)."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.asarray(self.formulas[key](self.resampled), dtype=np.float64)
