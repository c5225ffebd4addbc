"""The rules of the third round of checks (checks/setup_bugs.py): truncated sampling, quantized modules and the
prefill-to-decode boundary, from the streamed sums and the manifests to findings.

Margins sit between what clean runs show and what the planted faults show (docs/doctor.md has both).
"""

from __future__ import annotations

import math

from mismatch_probe.doctor.checks import setup_bugs as C
from mismatch_probe.doctor.stats.first_token import find_spike
from mismatch_probe.report.numbers import with_interval

# truncated_logprobs: the rollout sits above the other side on nearly every token. On a clean comparison the
# mean delta is a small fraction of the mean |delta| (noise is symmetric): at most 0.06 on the demo. At a
# share of 0.8 the tokens where the rollout is below add up to at most a ninth of those where it is above.
TRUNCATION_SHARE = 0.8
TRUNCATION_FLOOR = 0.01  # nats of mean one-sided shift
# where a side recorded kept_logmass, the mean shift is minus its mean (log of the kept mass): to a quarter
# of the shift, and 0.01 nats (the training side's own noise)
KEPT_TOLERANCE = 0.25
# quantized_router: module names of the routers and the LM head, as quant/targets.py's DEFAULT_SKIP spells them
# (kept here: the doctor starts without torch, which quant/ loads); tests/test_doctor_setup_bugs.py checks both.
ROUTER_NAMES = ("mlp.gate.", ".router.", "lm_head")
SHOWN = 8  # module names quoted in a finding's sentence (the evidence lists them all)


def known_truncation(facts, ref: str, cand: str) -> bool:
    """The rollout records processed (renormalised) log-probs and the other side scored over the full
    vocabulary: a known setting whose gap is no finding, and which explains every log-prob symptom."""
    roll = facts.rollout
    if roll not in (ref, cand):
        return False
    other = facts.sides.get(cand if ref == roll else ref)
    mine = facts.sides.get(roll)
    return bool(mine and mine.logprobs_mode == "processed" and not (other and other.logprobs_mode == "processed"))


def truncated(diagnosis, ref: str, cand: str, s: dict) -> bool:
    facts = diagnosis.facts
    roll = facts.rollout
    if roll not in (ref, cand):
        return False
    other = cand if ref == roll else ref
    n = s["n"]
    shift = (-s["delta"] if ref == roll else s["delta"]) / n  # mean of rollout minus other side
    mean_abs = s["abs"] / n
    if shift < TRUNCATION_FLOOR or shift < TRUNCATION_SHARE * mean_abs:
        return False
    ref_above, equal = s.get("n_ref_above", 0), s.get("n_equal", 0)
    above = (ref_above + equal if ref == roll else n - ref_above) / n
    kept, kept_side = None, None
    for side in (roll, other):
        value = facts.kept_logmass(side) if facts.kept_logmass else None
        if value is not None and value < -TRUNCATION_FLOOR:
            kept, kept_side = value, side
            break
    if kept is not None and abs(shift + kept) > KEPT_TOLERANCE * shift + TRUNCATION_FLOOR:
        return False  # the kept mass recorded does not account for the gap: not a truncation
    recorded = facts.top_p < 1 or facts.top_k > 0
    mode = facts.sides[roll].logprobs_mode if roll in facts.sides else None
    found = (
        f"{roll}: its log-probs sit above {other}'s by {shift:.3g} nats on average (mean |delta| {mean_abs:.3g}; "
        f"above or equal on {above:.1%} of tokens): renormalised over a truncated support of mass about "
        f"{math.exp(-shift):.2f}"
        + (
            f", as its recorded log kept mass says ({kept:.3g} nats on average, {kept_side})"
            if kept is not None
            else ""
        )
        + (
            f"; the run records top_p {facts.top_p:g}, top_k {facts.top_k} and log-prob mode {mode or 'unknown'}"
            if recorded
            else f"; the run records no truncation (top_p {facts.top_p:g}, top_k {facts.top_k})"
        )
    )
    diagnosis.add(
        C.TRUNCATED_LOGPROBS,
        roll,
        found,
        {
            "side": roll,
            "mean_rollout_minus_other": shift,
            "mean_abs_delta": mean_abs,
            "share_rollout_at_or_above": above,
            "support_mass": math.exp(-shift),
            "mean_kept_logmass": kept,
            "kept_logmass_side": kept_side,
            "top_k": facts.top_k,
            "top_p": facts.top_p,
            "logprobs_mode": mode,
            "n_tokens": int(n),
        },
    )
    return True


def first_token_spike(diagnosis, label: str, sums: dict) -> bool:
    spike = find_spike(sums)
    if spike is None:
        return False
    head, rest, ratio = spike["first"], spike["rest"], spike["ratio"]
    diagnosis.add(
        C.FIRST_TOKEN_SPIKE,
        label,
        f"{label}: mean |delta| is {with_interval(head['mean_abs_delta'], head['ci95'])} "
        f"on the first response token of {head['n_tokens']} samples and "
        f"{with_interval(rest['mean_abs_delta'], rest['ci95'])} on the {rest['n_tokens']} tokens after it ("
        + (f"{ratio:.1f}x" if math.isfinite(ratio) else "bitwise equal after")
        + f", {spike['z']:.0f} standard errors): the prefill-to-decode boundary",
        {
            "first": head,
            "rest": rest,
            "ratio": ratio if math.isfinite(ratio) else None,
            "z": spike["z"] if math.isfinite(spike["z"]) else None,
        },
    )
    return True


def _routers(modules) -> list[str]:
    return sorted(m for m in modules if any(name in m for name in ROUTER_NAMES))


def _names(modules: list[str]) -> str:
    return ", ".join(modules[:SHOWN]) + (f" and {len(modules) - SHOWN} more" if len(modules) > SHOWN else "")


def _quantized_modules(side) -> set[str] | None:
    """A side's quantized modules: empty when it is not quantized, None when it is over modules its manifest
    does not list (an SGLang or vLLM server names its scheme only: engines/serving/quantization.py)."""
    q = (side.quantization if side else None) or {}
    modules = q.get("quantized_modules") if q else []
    return None if modules is None else set(modules)


def quantization(diagnosis, pairs) -> None:
    """quantized_router: a side quantizes routers or the lm_head that the other side of a comparison does not.
    quant_modules_differ: both sides quantized, over different module sets. A quantized side against an
    unquantized one (a plain training pass against an FP8 rollout) is the setting under test, not a finding."""
    sides = diagnosis.facts.sides
    for ref, cand in pairs:
        a, b = sides.get(ref), sides.get(cand)
        qa, qb = _quantized_modules(a), _quantized_modules(b)
        if qa is None or qb is None:  # a side names its scheme but not its modules: nothing to compare
            continue
        for side, mine, theirs in ((ref, qa, qb), (cand, qb, qa)):
            routers = _routers(mine - theirs)
            if routers:
                diagnosis.add(
                    C.QUANTIZED_ROUTER,
                    side,
                    f"{side}: quantizes {len(routers)} router / lm_head module(s) that "
                    f"{cand if side == ref else ref} keeps unquantized ({_names(routers)})",
                    {"side": side, "modules": routers, "weight": (sides[side].quantization or {}).get("weight")},
                )
        if not (qa and qb) or qa == qb:
            continue
        only_a, only_b = sorted(qa - qb), sorted(qb - qa)
        diagnosis.add(
            C.QUANT_MODULES_DIFFER,
            f"{ref} vs {cand}",
            f"{ref} vs {cand}: both sides are quantized, over different modules: {len(only_a)} only on {ref}"
            + (f" ({_names(only_a)})" if only_a else "")
            + f", {len(only_b)} only on {cand}"
            + (f" ({_names(only_b)})" if only_b else ""),
            {
                "only_reference": only_a,
                "only_candidate": only_b,
                "n_reference": len(qa),
                "n_candidate": len(qb),
                "weight_reference": a.quantization.get("weight"),
                "weight_candidate": b.quantization.get("weight"),
            },
        )
