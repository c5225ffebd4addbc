"""Words for measured remedies (metrics.json `remedies`, remedies.py): what a variant changed, its effect, and
which advice of "What to do next" (actions.py) a variant measures.

An advice names the knob that would apply it (`Knob`); a sweep variant that changed that knob to that value
measured it, and the advice quotes the effect ("lm_head in fp32 on both sides: k3 ×0.42 [0.33, 0.53], at
0.97× the speed"). An advice no variant measured says so, with the `probe sweep` command that would.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.report import numbers
from mismatch_probe.rundir.layout import canonical_dtype
from mismatch_probe.rundir.sweep import BOTH_SIDES, TRAINING_SIDE

REMEDIES_KEY = "remedies"  # metrics.json's list of measured variants
K3 = "k3_kl"
ON_SIDE = {BOTH_SIDES: "on both sides", TRAINING_SIDE: "on the training side", "rollout": "on the rollout side"}
# How a known knob reads in a sentence; any other knob reads KNOB=VALUE.
KNOB_WORDS = {
    "lm_head_dtype": "lm_head in {}",
    "router_dtype": "router in {}",
    "moe_router_dtype": "router in {}",
    "dtype": "{} weights and compute",
    "attn_implementation": "{} attention",
}


def size_words(ratio: float) -> str:
    """A ratio's size, to 2 digits: `1.3% lower`, `25% higher` within a factor 2, else `3.2× higher`, `2.4× lower`."""
    two = lambda x: f"{float(f'{x:.2g}'):,g}"  # noqa: E731
    if ratio <= 0 or not math.isfinite(ratio):
        return f"{numbers.value(ratio)}×"
    if 0.5 <= ratio <= 2:
        change = abs(ratio - 1) * 100
        return f"{two(change)}% {'lower' if ratio < 1 else 'higher'}" if change else "unchanged"
    return f"{two(ratio)}× higher" if ratio > 1 else f"{two(1 / ratio)}× lower"


def _knob(key: str) -> str:
    """A knob's own name: megatron's nested `override_transformer_config.moe_router_dtype` is moe_router_dtype."""
    return str(key).rsplit(".", 1)[-1]


def _same(a, b) -> bool:
    a, b = str(a).lower(), str(b).lower()
    return a == b or (canonical_dtype(a) or a) == (canonical_dtype(b) or b)


def changed_words(entry: dict) -> str:
    """`lm_head in fp32 on both sides`, `moe_router_dtype=fp32, ... on the training side`."""
    parts = []
    for key, value in (entry.get("changed") or {}).items():
        words = KNOB_WORDS.get(_knob(key))
        parts.append(words.format(value) if words else f"{key}={value}")
    return f"{', '.join(parts) or 'nothing'} {ON_SIDE.get(entry.get('side'), '')}".strip()


def effect_words(entry: dict) -> str:
    """`k3 ×0.42 [0.33, 0.53], at 0.97× the speed`, with a word when the interval includes 1."""
    if entry.get("ratio") is None:
        return entry.get("note") or "not measured"
    text = f"k3 {numbers.times(entry['ratio'], entry.get('ratio_ci95'))}"
    if entry.get("significant") is True:
        text += f" (k3 {size_words(entry['ratio'])})"
    if entry.get("significant") is False:
        text += " (the interval includes 1: no effect resolved)"
    speed = entry.get("speed_ratio")
    return text + (f", at {numbers.value(speed)}× the speed" if speed is not None else ", speed not recorded")


@dataclass(frozen=True)
class Knob:
    """The knob that applies an advice: names it may be spelled by (megatron's nested or hf's), the value,
    and the `--vary` a sweep would measure it with."""

    names: tuple[str, ...]
    value: str
    vary: str  # SIDE:KNOB=VALUE


LM_HEAD_FP32 = Knob(names=("lm_head_dtype",), value="fp32", vary="both:lm_head_dtype=fp32")
ROUTER_FP32 = Knob(names=("router_dtype", "moe_router_dtype"), value="fp32", vary="both:router_dtype=fp32")
FP16 = Knob(names=("dtype",), value="fp16", vary="both:dtype=fp16")
DETERMINISTIC = Knob(
    names=("enable_deterministic_inference",), value="true", vary="rollout:enable_deterministic_inference=true"
)
SIDE_PREFERENCE = (BOTH_SIDES, TRAINING_SIDE, "rollout")  # an advice "on both sides" is measured best by both


def measuring(metrics: dict, knob: Knob) -> dict | None:
    """The measured variant that changed `knob` to its value, preferring both sides, then training."""
    found = [
        e
        for e in metrics.get(REMEDIES_KEY) or []
        if e.get("ratio") is not None
        and any(_knob(k) in knob.names and _same(v, knob.value) for k, v in (e.get("changed") or {}).items())
    ]
    found.sort(key=lambda e: SIDE_PREFERENCE.index(e["side"]) if e["side"] in SIDE_PREFERENCE else 3)
    return found[0] if found else None


def sweep_command(root: Path, engine: str, dtype: str, knob: Knob) -> str:
    """The sweep measuring `knob` against a base of this engine and dtype; an fp32 base would leave nothing for a
    precision knob to change, so its sweep starts from bf16."""
    dtype = "bf16" if canonical_dtype(dtype) == "fp32" else dtype
    return f"probe sweep {shlex.quote(str(root))} --engine {engine} --dtype {dtype} --vary {knob.vary}"


def measured_line(metrics: dict, knob: Knob, root: Path, engine: str, dtype: str) -> str:
    """`measured: lm_head in fp32 on both sides: k3 ×0.42 [...], at 0.97× the speed`, or `unmeasured: ...`."""
    entry = measuring(metrics, knob)
    if entry is None:
        return f"unmeasured: `{sweep_command(root, engine, dtype, knob)}` would measure it"
    return f"measured: {changed_words(entry)}: {effect_words(entry)} ({entry['variant']})"


HEADER = ["variant", "side", "changed", "k3 vs its rollout", "ratio to base [95%]", "pairing", "significant", "speed"]


def cells(entry: dict) -> list[str]:
    """One row of the remedies table (page and terminal): a variant not measured shows its note under k3."""
    changed = ", ".join(f"{key}={value}" for key, value in (entry.get("changed") or {}).items())
    measured = entry.get(K3) is not None
    significant = entry.get("significant")
    speed = entry.get("speed_ratio")
    return [
        entry["variant"],
        entry["side"],
        changed,
        numbers.with_interval(entry[K3], entry.get(f"{K3}_ci95")) if measured else entry.get("note") or "—",
        numbers.times(entry.get("ratio"), entry.get("ratio_ci95")),
        "paired" if entry.get("paired") else "unpaired",
        numbers.MISSING if significant is None else (f"yes: {size_words(entry['ratio'])}" if significant else "no"),
        numbers.MISSING if speed is None else f"{numbers.value(speed)}×",
    ]


def base_line(entries: list[dict]) -> str:
    """`base: rollout vs scores/hf-bf16, k3 1.2e-3`: what each ratio divides by."""
    first = entries[0]
    return f"base: rollout vs {first['base']}, k3 {numbers.value(first.get('base_k3_kl'))}"
