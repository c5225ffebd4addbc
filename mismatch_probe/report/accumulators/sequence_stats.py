"""Correction what-ifs (the numbers verl and slime log for TIS, rejection and ESS) and every headline metric
that has a 95% interval, from per-sequence sums in one streaming pass.

Each chunk's compared tokens are reduced to one column of sums per sequence (sequence_sums.py). Only
complete sequences are used: sequence-level keys (log_ppl_diff, chi2_seq, the geometric filter) are
non-linear in a sequence's tokens. Complete sequences then feed plain totals (the values) and
Poisson-bootstrap weighted totals (the intervals); see bootstrap.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.frames.bootstrap import RESAMPLES, SEED, ci_key, interval, poisson_weights
from mismatch_probe.frames.sequence_sums import OpenSequences, segment_maxima, segment_sums
from mismatch_probe.report.accumulators import verl_correction
from mismatch_probe.report.accumulators.verl_correction import (
    MAXIMA,
    SAFETY_BOUND,
    extrema_keys,
    sequence_extrema,
    sequence_values,
    token_extrema,
    token_maxima,
    token_values,
)
from mismatch_probe.report.keys.families import (
    EXTREME_FRACTION,
    K3_KL_SPLIT,
    N_TOKENS_SPLIT,
    SEQ_GEO_REJECT_FRACTION,
    TIS_CLIP_FRACTION,
)
from mismatch_probe.report.keys.levels import DEFAULT_GEO_BOUNDS, DEFAULT_THRESHOLDS, DEFAULT_TIS_CAPS, ROUTING_SPLITS

if TYPE_CHECKING:
    from mismatch_probe.frames.pair_frame import PairFrame

CHI2_CLAMP = SAFETY_BOUND  # |delta| (or a sequence's sum of delta) is clamped here before exp(2 x) in chi2
ROUTING_ROWS = "routing"  # PairFrame.before's name of judging_rows


def _ratio(num: int, den: int, scale: float = 1.0) -> Callable:
    return lambda t: t[num] / (t[den] * scale)


@dataclass
class SequenceStats:
    """Every headline key with a 95% interval, and the correction what-ifs: points from the plain totals,
    intervals from the same totals under Poisson weights, so a point and its interval share one implementation."""

    thresholds: tuple = DEFAULT_THRESHOLDS
    tis_caps: tuple = DEFAULT_TIS_CAPS
    geo_bounds: tuple = DEFAULT_GEO_BOUNDS
    num_layers: int = 0  # 0: no routing keys (dense model)
    resamples: int = RESAMPLES
    seed: int = SEED
    totals: np.ndarray = field(default=None)
    resampled: np.ndarray = field(default=None)  # [columns, resamples] weighted totals
    sequences: OpenSequences = field(default_factory=OpenSequences)  # token-level sums of unfinished sequences
    sequence_maxima: OpenSequences = field(default_factory=lambda: OpenSequences(combine=np.maximum))
    maxima: dict = field(default_factory=dict)  # verl's max/min keys, over tokens or complete sequences
    minima: dict = field(default_factory=dict)

    def __post_init__(self):
        # sums over the compared tokens (in the order _token_sums stacks them), then over the routed rows
        names = ["n", "k3", "k1", "k2", "abs_delta", "delta", "r", "r2", "chi2_token"]
        names += [f"extreme{i}" for i in range(len(self.thresholds))]
        names += [f"tis{i}" for i in range(len(self.tis_caps))]
        self.caps = [float(cap) for cap in self.tis_caps]
        self.bounds = [float(bound) for bound in self.geo_bounds]
        names += ["lp_ref", "lp_cand"] + token_values(np.zeros(0), self.caps)[1]
        names += [f"{stat}_{split}" for split in ROUTING_SPLITS for stat in ("n", "k3")]
        names += ["routed", "layers_differing", "tokens_differing"]
        self.token_columns = len(names)
        names += ["has", "neg_mean_delta", "abs_mean_delta", "exp_neg_mean_delta", "chi2_seq"]
        names += [f"geo{i}" for i in range(len(self.geo_bounds))]
        names += sequence_values(_empty(names), _empty(MAXIMA), self.caps, self.bounds)[1]
        self.column = {name: i for i, name in enumerate(names)}
        self.totals = np.zeros(len(names))
        self.resampled = np.zeros((len(names), self.resamples))
        self.limits = [float(t) for t in self.thresholds]
        self.formulas = self._formulas()

    def __getstate__(self) -> dict:
        """What a worker process sends back: everything but the formulas, closures that pickle cannot carry."""
        return {key: value for key, value in self.__dict__.items() if key != "formulas"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.formulas = self._formulas()

    def _formulas(self) -> dict[str, Callable]:
        """Every key as a function of the totals; the same function gives each resample's value."""
        c = self.column
        keys = {
            name: _ratio(c[col], c["n"])
            for name, col in (("k3_kl", "k3"), ("k1_kl", "k1"), ("k2_kl", "k2"), ("abs_logprob_diff_mean", "abs_delta"))
        }
        keys |= {EXTREME_FRACTION.at(t): _ratio(c[f"extreme{i}"], c["n"]) for i, t in enumerate(self.thresholds)}
        if self.num_layers:
            keys["router_diff_rate"] = _ratio(c["layers_differing"], c["routed"], self.num_layers)
            keys["token_diff_rate"] = _ratio(c["tokens_differing"], c["routed"])
            keys |= {K3_KL_SPLIT.at(split): _ratio(c[f"k3_{split}"], c[f"n_{split}"]) for split in ROUTING_SPLITS}
        # verl's names, verl's averaging: over every sequence, an empty one counting as 0 (as 1 in ppl_ratio)
        keys |= {
            name: _ratio(c[col], c["rows"])
            for name, col in (
                ("log_ppl_diff", "neg_mean_delta"),
                ("log_ppl_abs_diff", "abs_mean_delta"),
                ("ppl_ratio", "exp_neg_mean_delta"),
            )
        }
        keys["chi2_token"] = _ratio(c["chi2_token"], c["n"])
        keys["chi2_seq"] = _ratio(c["chi2_seq"], c["rows"])
        keys["is_ess"] = lambda t: t[c["r"]] ** 2 / (t[c["n"]] * t[c["r2"]])
        keys |= {TIS_CLIP_FRACTION.at(cap): _ratio(c[f"tis{i}"], c["n"]) for i, cap in enumerate(self.tis_caps)}
        keys |= {SEQ_GEO_REJECT_FRACTION.at(b): _ratio(c[f"geo{i}"], c["has"]) for i, b in enumerate(self.geo_bounds)}
        keys |= verl_correction.formulas(c, self.tis_caps, self.geo_bounds)
        return keys

    def update(self, frame: PairFrame) -> None:
        if len(frame.rows.segment_ids) == 0:
            return
        ids = frame.rows.segment_ids
        maxima = segment_maxima(token_maxima(frame.delta), frame.segment, len(ids))
        closed, sums = self.sequences.add(ids, self._token_sums(frame))
        # the chunk's weights where another accumulator (the per-step split) has drawn them already
        shared = (self.seed, self.resamples) == (SEED, RESAMPLES) and len(closed) and frame.rows.has_weights
        weights = frame.rows.weights_of(closed) if shared else None
        self._add_sequences(closed, sums, self.sequence_maxima.add(ids, maxima), weights)

    def merge(self, other: SequenceStats) -> None:
        self.totals += other.totals
        self.resampled += other.resampled
        self.sequences.merge(other.sequences)
        self.sequence_maxima.merge(other.sequence_maxima)
        self._extremes(other.maxima, other.minima)

    def finish(self) -> dict:
        closed = self.sequences.close(self.token_columns)
        self._add_sequences(*closed, self.sequence_maxima.close(len(MAXIMA)))
        return {"metrics": self.metrics()}

    def _token_sums(self, frame: PairFrame) -> np.ndarray:
        """[token columns, sequences of the chunk] sums over each sequence's compared tokens and routed rows."""
        m, c = len(frame.rows.segment_ids), self.column
        delta, r, k3 = frame.delta, frame.r, frame.k3
        values = [
            k3,
            -delta,
            0.5 * delta * delta,
            frame.abs_delta,
            delta,
            r,
            r * r,
            np.expm1(2.0 * np.clip(delta, -CHI2_CLAMP, CHI2_CLAMP)),
        ]
        values += [frame.ratio_max > t for t in self.limits]
        verl_values, verl_names = token_values(delta, self.caps)  # clamped and exponentiated once per chunk
        verl = dict(zip(verl_names, verl_values, strict=True))
        clamped = verl["raw_w"]  # verl's weights exp(clamp(delta, ±20)): no different below C = e^20
        values += [clamped > cap for cap in self.caps]
        values += [frame.lp_ref, frame.lp_cand] + verl_values
        self._extremes(*token_extrema(verl, len(self.caps)))
        routed = frame.routing
        if routed is not None:
            # k3 split by whether any layer's expert set differs, where both sides route, judged on row p - 1:
            # the forward whose input is token p - 1 is the one that scored token p
            has, (before, layers) = frame.before[ROUTING_ROWS]
            used, differs = (has & before)[frame.compared], layers[frame.compared] > 0
            same, diff = used & ~differs, used & differs
            values += [same, k3 * same, diff, k3 * diff]
        sums = np.zeros((self.token_columns, m))
        sums[c["n"]] = np.bincount(frame.segment, minlength=m)
        sums[1 : 1 + len(values)] = segment_sums(np.array(values, dtype=np.float64), frame.segment, m)
        if routed is not None:
            at, layers = frame.rows.segment[routed.rows], routed.layers_differing[routed.rows]
            sums[c["routed"]] = np.bincount(at, minlength=m)
            sums[c["layers_differing"] :] = segment_sums(np.array([layers, layers > 0], dtype=np.float64), at, m)
        return sums

    def _add_sequences(
        self, ids: np.ndarray, token_sums: np.ndarray, maxima: tuple[np.ndarray, np.ndarray], weights=None
    ) -> None:
        """Complete sequences: their token sums, and (the same ids, [MAXIMA, k]) their token maxima; weights,
        their Poisson weights when the caller has them."""
        if len(ids) == 0:
            return
        c = self.column
        n = token_sums[c["n"]]
        has = n > 0
        mean_delta = np.divide(token_sums[c["delta"]], n, out=np.zeros_like(n), where=has)
        seq_sum = np.clip(token_sums[c["delta"]], -CHI2_CLAMP, CHI2_CLAMP)
        seq = [
            has.astype(np.float64),
            -mean_delta,
            np.abs(mean_delta),
            np.exp(-mean_delta),
            np.expm1(2.0 * seq_sum),
        ]
        geo_ratio = np.exp(np.abs(mean_delta))
        seq += [(geo_ratio > bound) & has for bound in self.bounds]
        sums = {name: token_sums[c[name]] for name in list(c)[: self.token_columns]}
        assert np.array_equal(maxima[0], ids)  # both trackers saw the same sequences
        by_name = dict(zip(MAXIMA, maxima[1], strict=True))
        verl_values, verl_names = sequence_values(sums, by_name, self.caps, self.bounds)
        seq += verl_values
        per_sequence = dict(zip(verl_names, verl_values, strict=True)) | {"neg_mean_delta": -mean_delta, "has": has}
        per_sequence["sum_delta"] = token_sums[c["delta"]]
        self._extremes(*sequence_extrema(per_sequence, self.caps))
        columns = np.vstack([token_sums, np.array(seq, dtype=np.float64)])
        self.totals += columns.sum(axis=1)
        if weights is None:
            weights = poisson_weights(ids, self.seed, self.resamples)
        self.resampled += columns @ weights

    def metrics(self) -> dict:
        """Each key's value and its `KEY_ci95` interval (null where the value is)."""
        out = self._routing_split_counts()
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for key, formula in self.formulas.items():
                point = formula(self.totals)
                out[key] = float(point) if np.isfinite(point) else None
                out[ci_key(key)] = None if out[key] is None else interval(formula(self.resampled))
        names = extrema_keys(self.tis_caps)
        out |= {names[name]: value for name, value in (self.maxima | self.minima).items()}
        out |= {key: None for key in names.values() if key not in out}
        if out[N_TOKENS_SPLIT.at(ROUTING_SPLITS[0])] is None:  # dense, or no position routed on both sides
            out |= {
                key: None for split in ROUTING_SPLITS for key in (K3_KL_SPLIT.at(split), ci_key(K3_KL_SPLIT.at(split)))
            }
        return out

    def _routing_split_counts(self) -> dict:
        routed = self.num_layers and self.totals[self.column["routed"]] > 0
        return {
            N_TOKENS_SPLIT.at(split): int(self.totals[self.column[f"n_{split}"]]) if routed else None
            for split in ROUTING_SPLITS
        }

    def _extremes(self, maxima: dict, minima: dict) -> None:
        for name, value in maxima.items():
            self.maxima[name] = max(self.maxima.get(name, value), value)
        for name, value in minima.items():
            self.minima[name] = min(self.minima.get(name, value), value)

    def resampled_values(self, key: str) -> np.ndarray:
        """[resamples] values of `key` in each bootstrap resample. The weights depend only on (seed, sample_id,
        resample), so two comparisons over the same sequences line up resample by resample (paired bootstrap)."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.asarray(self.formulas[key](self.resampled), dtype=np.float64)


def judging_rows(frame: PairFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per row: routed on both sides, and the MoE layers whose expert sets differ; the routing scope's rows,
    plus each sequence's last prompt row, which scores its first response token even under
    `--routing-scope response` (compared here, a few rows per chunk)."""
    routed, rows = frame.routing, frame.rows
    judged, layers = routed.rows.copy(), routed.layers_differing.copy()
    last_prompt = np.flatnonzero(~rows.is_response[:-1] & rows.is_response[1:] & (np.diff(rows.sample_id) == 0))
    if len(rows.is_response) and not rows.is_response[-1]:  # its response may begin in the next chunk
        last_prompt = np.append(last_prompt, len(rows.is_response) - 1)
    if last_prompt.size:
        ref, cand = frame.ref, frame.cand
        a, b = np.sort(ref.experts[last_prompt], axis=-1), np.sort(cand.experts[last_prompt], axis=-1)
        judged[last_prompt] = ref.experts_valid[last_prompt] & cand.experts_valid[last_prompt]
        layers[last_prompt] = (a != b).any(axis=-1).sum(axis=-1)
    return judged, layers


def _empty(names) -> dict[str, np.ndarray]:
    return {name: np.zeros(0) for name in names}
