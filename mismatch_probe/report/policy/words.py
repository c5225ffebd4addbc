"""One sentence for the page and the terminal: which replay, R2 or R3, adds less bias at each step, and how
sure that is. It compares `replay_bias_k3_kl` of the R2 and the R3 pass of a step; "significant" only where
their 95% intervals do not overlap (a conservative test: overlapping intervals may still differ)."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.vocab import R2, R3

BIAS = "replay_bias_k3_kl"
NAMES = {R2: "R2", R3: "R3"}


@dataclass(frozen=True)
class Outcome:
    step: int | None
    less: str | None  # "r2" or "r3", None for a tie
    apart: bool  # the two intervals do not overlap


def _apart(a: list | None, b: list | None) -> bool:
    return bool(a) and bool(b) and (a[1] < b[0] or b[1] < a[0])


def steps_phrase(steps: list) -> str:
    """`step 0`, `steps 0, 1, 4`; a pass scored without --policy-step is `the unnumbered step`."""
    named = [str(s) for s in steps if s is not None]
    text = ("step " if len(named) == 1 else "steps ") + ", ".join(named) if named else ""
    if None in steps:
        text = f"{text} and the unnumbered step" if text else "the unnumbered step"
    return text


def outcomes(comparisons: list[dict]) -> tuple[list[Outcome], dict]:
    """The R2 against R3 outcome of each step that has both with a bias; {step: replay} of steps with one."""
    by_step: dict = {}
    for comp in comparisons:
        if is_policy(comp) and comp.get("replay") in NAMES and comp["metrics"].get(BIAS) is not None:
            by_step.setdefault(comp.get("policy_step"), {})[comp["replay"]] = comp["metrics"]
    found, alone = [], {}
    for step in sorted(by_step, key=lambda s: (s is None, s or 0)):
        sides = by_step[step]
        if len(sides) < 2:
            alone[step] = next(iter(sides))
            continue
        r2, r3 = sides[R2], sides[R3]
        less = None if r2[BIAS] == r3[BIAS] else (R2 if r2[BIAS] < r3[BIAS] else R3)
        found.append(Outcome(step=step, less=less, apart=_apart(r2.get(ci_key(BIAS)), r3.get(ci_key(BIAS)))))
    return found, alone


def _sureness(group: list[Outcome]) -> str:
    apart = [o.step for o in group if o.apart]
    overlap = [o.step for o in group if not o.apart]
    if not overlap:
        return "significantly: the 95% intervals are apart"
    if not apart:
        return "not significantly: the 95% intervals overlap"
    return f"significantly at {steps_phrase(apart)}, not significantly at {steps_phrase(overlap)}"


def replay_bias_sentence(comparisons: list[dict]) -> str | None:
    """None without policy comparisons; else which replay adds less bias where, and how sure."""
    if not any(is_policy(c) for c in comparisons):
        return None
    found, alone = outcomes(comparisons)
    parts = []
    for less, more in ((R2, R3), (R3, R2)):
        group = [o for o in found if o.less == less]
        if group:
            parts.append(
                f"{NAMES[less]} adds less replay bias than {NAMES[more]} at {steps_phrase([o.step for o in group])} "
                f"({_sureness(group)})"
            )
    ties = [o.step for o in found if o.less is None]
    if ties:
        parts.append(f"R2 and R3 add the same replay bias at {steps_phrase(ties)}")
    for replay in (R2, R3):
        steps = [step for step, only in alone.items() if only == replay]
        if steps:
            other = NAMES[R3 if replay == R2 else R2]
            parts.append(f"only {NAMES[replay]} was scored at {steps_phrase(steps)} (no {other} to compare)")
    if not parts:
        return "No R2 or R3 pass has a replay bias: nothing to compare the replays by."
    text = "; ".join(parts) + "."
    return text[:1].upper() + text[1:]
