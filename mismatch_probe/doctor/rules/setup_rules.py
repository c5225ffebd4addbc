"""From the streamed sums to findings: each check's rule and its margins.

The margins are set between what clean runs show and what the planted faults show (SPEC section 7a), far
from both, so that another model or seed does not cross them: a margin tuned to one fixture would. The
clean figures quoted are the demo's nine MoE and seven dense comparisons (2,048 samples at T = 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mismatch_probe.doctor.checks import check_list as C
from mismatch_probe.doctor.checks.engine_bugs import LAYER_ROUTES_OUTLIER, POSITION_ONSET
from mismatch_probe.doctor.checks.setup_bugs import FIRST_TOKEN_SPIKE
from mismatch_probe.doctor.finding import Finding
from mismatch_probe.doctor.rules import decode_rules, engine_rules, setup_checks
from mismatch_probe.doctor.stats.temperature import TEMPERATURE_RATIO, calibration, culprit
from mismatch_probe.rundir.layout import ROLLOUT, canonical_dtype
from mismatch_probe.vocab import ENGINE_PREFILL

MIN_TOKENS = 20  # under this a comparison's numbers rest on nothing (too_few_tokens), and no rule fires
# off_by_one: a shift makes |delta| far larger on clean runs (demo: 0.005-0.011 -> 2.3 nats). A real shift is
# the reverse: the shifted mean |delta| is at most a fifth of the unshifted one, which is well above noise.
SHIFT_FACTOR = 5.0
SHIFT_FLOOR = 0.05  # nats of mean |delta| unshifted; clean comparisons sit near 0.01
# weights_differ without differing fingerprints: k3 over tokens routed alike, against an absolute floor 40x
# the demo's ordinary same-dtype engine gap (2.6e-4; its largest clean k3 is 8e-4) and tens of times the
# repeated-pass noise floor; a run without repeated passes has no floor, and then only fingerprints decide.
WEIGHTS_K3 = 1e-2
WEIGHTS_FLOOR_FACTOR = 30.0
# replay_misaligned: routes match the other side's one position away at least twice as often, and by
# a fifth of all tokens more, than at the same position (demo: 0.97-1.0 at the same position, 0.014 shifted).
ROUTE_FACTOR = 2.0
ROUTE_MARGIN = 0.2
EMPTY_SHARE = 0.5  # "most responses are empty"
PER_SIDE = (
    C.OFF_BY_ONE,
    C.REPLAY_MISALIGNED,
    C.WEIGHTS_DIFFER,
    LAYER_ROUTES_OUTLIER,
    POSITION_ONSET,
    FIRST_TOKEN_SPIKE,
)


@dataclass
class SideFacts:
    """What the manifests say about a side."""

    name: str
    dtype: str | None = None
    fingerprint: dict | None = None
    repeat_group: str | None = None
    logprobs_mode: str | None = None  # the manifest's sampling.logprobs_mode: raw, processed, or None (unknown)
    quantization: dict | None = None  # the manifest's quantization entry
    kind: str | None = None  # a score set's kind: engine-prefill for the inference engine's own prefill


@dataclass
class RunFacts:
    temperature: float | None  # None: unknown (an imported dump); the temperature checks then stay silent
    top_k: int = 0
    top_p: float = 1.0
    sides: dict[str, SideFacts] = field(default_factory=dict)
    rollout: str = "rollout"
    # a side's mean recorded log kept mass (kept_logmass) over its response tokens, None without one; read
    # only when truncated_logprobs needs it
    kept_logmass: Callable[[str], float | None] | None = None


@dataclass
class Diagnosis:
    facts: RunFacts
    findings: list[Finding] = field(default_factory=list)
    seen: set = field(default_factory=set)  # (check, sides) of each finding
    pair: tuple[str, str] = ("", "")  # the comparison being diagnosed
    fired: dict = field(default_factory=dict)  # check -> the sides of every comparison it fired on

    def add(self, check, subject: str, found: str, evidence: dict) -> None:
        """One finding per (check, side): a side's bug shows in each comparison it is in. A comparison's
        finding that shares a side with an earlier one of the same check is that one's, seen again."""
        # a shift or other weights belong to one side of the comparison: the one it shares with another
        sides = self.pair if check in PER_SIDE and subject == " vs ".join(self.pair) else (subject,)
        self.fired.setdefault(check.name, []).append(sides)
        for name, seen in self.seen:
            if name == check.name and set(seen) & set(sides):
                return
        self.seen.add((check.name, sides))
        self.findings.append(Finding.of(check, found, evidence))

    def settle(self) -> list[Finding]:
        """The findings, less the lost routes that a misalignment explains: routes moved one position
        earlier leave each sample one row short at its end, which is the shift, not a prefix cache."""
        shifted = {side for name, sides in self.seen if name == C.REPLAY_MISALIGNED.name for side in sides}
        kept = [
            f
            for f in self.findings
            if not (
                f.check == C.ROUTING_ROWS_LOST.name
                and f.evidence["side"] in shifted
                and f.evidence["lost_rows"] <= f.evidence["lost_samples"]
            )
        ]
        return [self._blame(f) for f in kept]

    def _blame(self, finding: Finding) -> Finding:
        """A comparison's finding of a per-side check names the side when the comparisons it fired on
        share exactly one: a rollout shifted by one shows against every score set, and only there."""
        pairs = self.fired.get(finding.check, [])
        if finding.check not in {c.name for c in PER_SIDE} or len(pairs) < 2 or "side" in finding.evidence:
            return finding
        common = set(pairs[0]).intersection(*pairs[1:])
        if len(common) != 1:
            return finding
        (side,) = common
        found = f"{finding.found} ({side} is in each of the {len(pairs)} comparisons that show it)"
        return replace(finding, found=found, evidence=finding.evidence | {"side": side})

    # ---- whole run --------------------------------------------------------------------------------
    def greedy(self) -> None:
        if self.facts.temperature == 0:
            self.add(
                C.GREEDY,
                "run",
                "the rollout was sampled at temperature 0 (greedy): it is scored at T = 1, and F(t), k3 and "
                "importance weights describe no sampler RL uses",
                {"temperature": 0.0},
            )

    def side(self, name: str, t: dict) -> None:
        if name == self.facts.rollout and t["n_samples"] and t["n_empty"] / t["n_samples"] > EMPTY_SHARE:
            self.add(
                C.EMPTY_RESPONSES,
                name,
                f"{t['n_empty']} of {t['n_samples']} responses are empty ({t['n_eos_only']} hold only the end token)",
                {k: t[k] for k in ("n_samples", "n_empty", "n_eos_only")},
            )
        if name == self.facts.rollout and t.get("n_past_eos"):
            named = ", ".join(map(str, t["past_eos_samples"]))
            more = (
                f" and {t['n_past_eos'] - len(t['past_eos_samples'])} more"
                if t["n_past_eos"] > len(t["past_eos_samples"])
                else ""
            )
            self.add(
                C.PAST_END_TOKEN,
                name,
                f"{t['n_past_eos']} of {t['n_samples']} responses go on after an end token "
                f"({', '.join(map(str, t['eos_ids']))}): samples {named}{more}",
                {k: t[k] for k in ("n_samples", "n_past_eos", "past_eos_samples", "eos_ids")},
            )
        if t["routed_rows"] and t["lost_rows"]:
            sample, position = t["first_lost"] or (None, None)
            self.add(
                C.ROUTING_ROWS_LOST,
                name,
                f"{name}: {t['lost_rows']} rows in {t['lost_samples']} samples have no route although a later "
                f"token of the sample was forwarded (first: sample {sample} position {position})",
                {k: t[k] for k in ("lost_rows", "lost_samples", "routed_rows", "n_rows")}
                | {"side": name, "first_sample": sample, "first_position": position},
            )
        if t["routed_rows"] and t["shifted_samples"] > t["n_samples"] / 2:
            self.add(
                C.REPLAY_MISALIGNED,
                name,
                f"{name}: in {t['shifted_samples']} of {t['n_samples']} samples the first token has no route and "
                "the last one has: routing rows sit one position after their tokens",
                {k: t[k] for k in ("shifted_samples", "n_samples")},
            )

    # ---- one comparison ---------------------------------------------------------------------------------
    def comparison(self, ref: str, cand: str, s: dict, noise_floor: float | None, extra: dict | None = None) -> None:
        """`extra`: the second round's sums of this comparison (state.Doctor): `runs`, `positions`, and for a
        MoE run `layers` with `route_skip` (layers named by routes_constant or routes_invalid) and `model_layers`."""
        label, n, extra = f"{ref} vs {cand}", int(s.get("n", 0)), extra or {}
        if n < MIN_TOKENS:
            self.add(
                C.TOO_FEW_TOKENS,
                label,
                f"{label}: {n} response tokens compared (fewer than {MIN_TOKENS}): its metrics mean nothing",
                {"n_tokens": n, "minimum": MIN_TOKENS},
            )
            return
        self.pair = (ref, cand)
        # Log-probs mangled in transport explain every other log-prob symptom, and so does a shift;
        # misaligned routes (or one layer's foreign routes) explain a large k3, and so does a step at a position.
        if "runs" in extra and engine_rules.cumulative(self, ref, cand, s, extra["runs"], MIN_TOKENS):
            return
        shifted = self._shift(label, s)
        routes = self._routes(label, s)
        if not routes and "layers" in extra:
            routes = engine_rules.layer_outlier(
                self, label, extra["layers"], extra["route_skip"], extra["model_layers"]
            )
        # Truncated log-probs shift the rollout's log-prob on every token: named as truncation before a
        # temperature is fitted; and a rollout that records them (processed mode) against a full-vocabulary
        # side is a known setting whose gap explains every log-prob symptom.
        if shifted or setup_checks.known_truncation(self.facts, ref, cand):
            return
        if self.facts.temperature != 0 and (
            setup_checks.truncated(self, ref, cand, s) or self._temperature(ref, cand, s)
        ):
            return
        # A KV cache (and its fp8 rounding) lives in the inference engine: a step by position is judged where the
        # rollout is one side. Two full-forward training passes differ by position too (more context, more
        # rounding), and on a small run that reads as a step (measured: 8.5x at position 7, 48 tokens before it).
        prefill = self.facts.sides.get(cand)
        if ref == ROLLOUT and prefill is not None and prefill.kind == ENGINE_PREFILL and "positions" in extra:
            if decode_rules.decode_path(self, label, s, noise_floor, extra["positions"], extra.get("cache")):
                return  # the step by position is the decode path's: not position_onset's nor other weights'
        decoded = ROLLOUT in (ref, cand)
        onset = decoded and "first" in extra and setup_checks.first_token_spike(self, label, extra["first"])
        onset = onset or (
            decoded and "positions" in extra and engine_rules.position_onset(self, label, extra["positions"])
        )
        if not (routes or onset):
            self._weights(ref, cand, s, noise_floor)

    def _shift(self, label: str, s: dict) -> bool:
        mean = s["abs"] / s["n"]
        shifted = {name: s[f"abs_{name}"] / s[f"n_{name}"] for name in ("later", "earlier") if s[f"n_{name}"]}
        if not shifted:
            return False
        best = min(shifted, key=shifted.get)
        if s[f"n_{best}"] < MIN_TOKENS or mean < SHIFT_FLOOR or shifted[best] * SHIFT_FACTOR > mean:
            return False
        where = "p+1" if best == "later" else "p-1"
        self.add(
            C.OFF_BY_ONE,
            label,
            f"{label}: mean |delta| is {mean:.3g} nats as stored but {shifted[best]:.3g} when the candidate's row "
            f"{where} is compared with the reference's row p: one side's log-probs sit one position off",
            {
                "mean_abs_delta": mean,
                "mean_abs_delta_candidate_later": shifted.get("later"),
                "mean_abs_delta_candidate_earlier": shifted.get("earlier"),
                "n_tokens": int(s["n"]),
            },
        )
        return True

    def _routes(self, label: str, s: dict) -> bool:
        pairs = s.get("route_pairs", 0)
        if pairs < MIN_TOKENS:
            return False
        same = s["route_same"] / pairs
        shifted = {name: s[f"route_{name}"] / pairs for name in ("later", "earlier")}
        best = max(shifted, key=shifted.get)
        if shifted[best] < ROUTE_FACTOR * same or shifted[best] - same < ROUTE_MARGIN:
            return False
        self.add(
            C.REPLAY_MISALIGNED,
            label,
            f"{label}: routes agree in every layer on {same:.1%} of tokens at the same position but on "
            f"{shifted[best]:.1%} with the candidate one position {best}",
            {"route_match_same_position": same, "route_match_candidate_later": shifted["later"]}
            | {"route_match_candidate_earlier": shifted["earlier"], "tokens_checked": int(pairs)},
        )
        return True

    def _temperature(self, ref: str, cand: str, s: dict) -> bool:
        if self.facts.temperature is None or s.get("n_gap", 0) < MIN_TOKENS or s["gap_cand"] <= 0:
            return False
        ratio = s["gap_ref"] / s["gap_cand"]  # = T_cand / T_ref
        if abs(math.log(ratio)) < math.log(TEMPERATURE_RATIO):
            return False
        cal = {side: calibration(s, side, MIN_TOKENS) for side in ("ref", "cand")}
        recorded = self.facts.temperature
        off = culprit(cal, ratio, recorded)
        side = ref if off == "ref" else cand
        fitted = recorded / ratio if off == "ref" else recorded * ratio
        check = C.PROCESSED_LOGPROBS if side == self.facts.rollout else C.TEMPERATURE_MISMATCH
        evidence = {
            "gap_ratio": ratio,
            "recorded_temperature": recorded,
            "fitted_temperature": fitted,
            "side": side,
            "n_tokens": int(s["n_gap"]),
            "calibration_reference": cal["ref"],
            "calibration_candidate": cal["cand"],
        }
        self.add(
            check,
            side,
            f"{side}: its log-probs fit temperature {fitted:.3g}, not the recorded {recorded:g} (sampled-token to "
            f"top-1 gap ratio {ref} / {cand} = {ratio:.3f}; 1.000 when both sides use the same temperature)",
            evidence,
        )
        return True

    def _weights(self, ref: str, cand: str, s: dict, noise_floor: float | None) -> None:
        a, b = self.facts.sides.get(ref), self.facts.sides.get(cand)
        label = f"{ref} vs {cand}"
        fa, fb = (a.fingerprint if a else None), (b.fingerprint if b else None)
        comparable = fa and fb and fa.get("tensors") == fb.get("tensors") and fa.get("rounding") == fb.get("rounding")
        if comparable and fa["sha256"] != fb["sha256"]:
            self.add(
                C.WEIGHTS_DIFFER,
                label,
                f"{label}: weight fingerprints differ ({ref} {fa['sha256'][:12]}, {cand} {fb['sha256'][:12]})",
                {"fingerprint_reference": fa, "fingerprint_candidate": fb, "k3_kl": s["k3"] / s["n"]},
            )
            return
        # Equal fingerprints cover only the fingerprinted tensors (a refit may skip others): k3 still decides.
        dtype = canonical_dtype(a.dtype) if a and b else None
        if noise_floor is None or dtype is None or dtype != canonical_dtype(b.dtype):
            return  # "far above the noise floor" needs a floor: repeated passes (rescore --repeats 2)
        n_same = int(s.get("n_same", 0))
        k3, tokens = (s["k3_same"] / n_same, n_same) if n_same >= MIN_TOKENS else (s["k3"] / s["n"], int(s["n"]))
        limit = max(WEIGHTS_K3, WEIGHTS_FLOOR_FACTOR * (noise_floor or 0.0))
        if "route_pairs" in s and n_same < MIN_TOKENS:
            return  # routing differs nearly everywhere: k3 may be routing's, not the weights'
        if k3 < limit:
            return
        self.add(
            C.WEIGHTS_DIFFER,
            label,
            f"{label}: k3 {k3:.3g} over {tokens} tokens routed alike, both sides {dtype}, is over "
            f"{limit:.3g} (repeated-pass noise floor {noise_floor:.3g}); "
            + (
                "the fingerprinted tensors agree, so other tensors differ"
                if comparable
                else "no weight fingerprint on both sides to confirm"
            ),
            {"k3_kl_routing_same": k3, "n_tokens": tokens, "limit": limit, "noise_floor": noise_floor}
            | {"dtype": dtype},
        )
