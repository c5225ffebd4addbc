"""The effects `probe demo` exists to show, each with its 95% intervals and whether they separate."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from rich.table import Table

from mismatch_probe.frames.bootstrap import ci_key
from mismatch_probe.pipeline.demo.production import PRODUCTION_RUNS, ProductionRollout
from mismatch_probe.pipeline.demo.sweep import SWEEP_BASE, SWEEP_ROWS, SWEEP_RUN, SweepRow
from mismatch_probe.report.keys.families import EXTREME_FRACTION
from mismatch_probe.report.numbers import count, percent, times, with_interval

MIN_EXTREME_TOKENS = 20  # F(2) resting on fewer tokens is one or two tokens' worth of noise
RATIO = "ratio"  # a sweep row's key: the variant's k3 over the base's (metrics.json `remedies`)


@dataclass(frozen=True)
class Contrast:
    """`key` of (higher kind, higher score set) should exceed that of (lower kind, lower score set)."""

    label: str
    higher: tuple[str, str]
    lower: tuple[str, str]
    key: str = "k3_kl"


CONTRASTS = (
    Contrast(label="MoE k3 > dense k3, hf bf16", higher=("moe", "hf-bf16"), lower=("dense", "hf-bf16")),
    Contrast(label="MoE k3 > dense k3, hf fp32", higher=("moe", "hf-fp32"), lower=("dense", "hf-fp32")),
    Contrast(label="no R3 k3 > R3 k3, hf bf16", higher=("moe", "hf-bf16"), lower=("moe", "hf-bf16-r3")),
    Contrast(label="no R3 k3 > R3 k3, hf fp32", higher=("moe", "hf-fp32"), lower=("moe", "hf-fp32-r3")),
    Contrast(
        label="no R3 k3 > R3 k3, megatron bf16", higher=("moe", "megatron-bf16"), lower=("moe", "megatron-bf16-r3")
    ),
)
# What the papers predict once the policy moves (SPEC section 7b): each a policy comparison's key, by its candidate.
POLICY_CONTRASTS = (
    Contrast(
        label="replay bias at step 0: R3 > R2 (R2's is 0)",
        higher=("moe", "hf-fp32-r3-step0"),
        lower=("moe", "hf-fp32-r2-step0"),
        key="replay_bias_k3_kl",
    ),
    Contrast(
        label="R3 lowers tid k3, step 1",
        higher=("moe", "hf-fp32-step1"),
        lower=("moe", "hf-fp32-r3-step1"),
        key="tid_k3_kl",
    ),
    Contrast(
        label="stale k3 grows with the step: 8 > 1, natural",
        higher=("moe", "hf-fp32-step8"),
        lower=("moe", "hf-fp32-step1"),
    ),
    Contrast(
        label="mean γ falls with the step: 1 > 8, natural",
        higher=("moe", "hf-fp32-step1"),
        lower=("moe", "hf-fp32-step8"),
        key="router_shift_ratio_mean",
    ),
)
EXTREME_KEY = EXTREME_FRACTION.at(2)
EXTREME_SIDE = ("moe", "hf-fp32")


def _vs_rollout(results: dict, kind: str, name: str) -> dict:
    """The score set's metrics against the rollout, or for a new policy's pass its policy comparison's."""
    for comp in results.get(kind, {}).get("comparisons", []):
        if comp["candidate"] == f"scores/{name}" and (comp["reference"] == "rollout" or comp.get("kind") == "policy"):
            return comp["metrics"]
    return {}


def effects(results: dict) -> list[dict]:
    """One row per effect: both values with intervals, and `separates` (intervals do not overlap; for a production
    rollout's share row, the share's interval lies above 0; for a sweep row, the ratio's interval excludes 1)."""
    rows = []
    for c in CONTRASTS + POLICY_CONTRASTS:
        high, low = _vs_rollout(results, *c.higher), _vs_rollout(results, *c.lower)
        high_ci, low_ci = high.get(ci_key(c.key)), low.get(ci_key(c.key))
        rows.append(
            asdict(c)
            | {
                "higher_value": high.get(c.key),
                "higher_ci95": high_ci,
                "lower_value": low.get(c.key),
                "lower_ci95": low_ci,
                "separates": bool(high_ci and low_ci and high_ci[0] > low_ci[1]),
            }
        )
    metrics = _vs_rollout(results, *EXTREME_SIDE)
    count = round((metrics.get(EXTREME_KEY) or 0.0) * (metrics.get("n_tokens") or 0))
    rows.append(
        {
            "label": f"MoE fp32 F(2) rests on >= {MIN_EXTREME_TOKENS} extreme tokens",
            "key": EXTREME_KEY,
            "higher": list(EXTREME_SIDE),
            "higher_value": metrics.get(EXTREME_KEY),
            "higher_ci95": metrics.get(ci_key(EXTREME_KEY)),
            "extreme_tokens": count,
            "n_tokens": metrics.get("n_tokens"),
            "separates": count >= MIN_EXTREME_TOKENS,
        }
    )
    return rows + [share_row(results, p) for p in PRODUCTION_RUNS] + [sweep_row(results, r) for r in SWEEP_ROWS]


def share_row(results: dict, p: ProductionRollout) -> dict:
    """A production rollout's share (its report's quant_share or truncation_share entry for the plain and matched
    passes): the two passes' k3 as the higher and lower side, the share with its paired interval, and `separates`
    when that interval lies above 0 (the matched pass lowers k3 beyond the bootstrap's noise)."""
    entries = results.get(p.name, {}).get("attribution", {}).get(p.share) or []
    plain, matched = f"scores/{p.plain}", f"scores/{p.matched}"
    entry = next((e for e in entries if (e["plain"], e["matched"]) == (plain, matched)), {})
    share_ci = entry.get("share_ci95")
    return {
        "label": p.label,
        "key": p.share,
        "higher": [p.name, p.plain],
        "lower": [p.name, p.matched],
        "higher_value": entry.get("k3_kl_plain"),
        "higher_ci95": entry.get("k3_kl_plain_ci95"),
        "lower_value": entry.get("k3_kl_matched"),
        "lower_ci95": entry.get("k3_kl_matched_ci95"),
        "share": entry.get("share"),
        "share_ci95": share_ci,
        "separates": bool(share_ci and share_ci[0] > 0),
    }


def sweep_row(results: dict, row: SweepRow) -> dict:
    """A variant of the demo's sweep: its report's `remedies` entry (matched by side and what it changed) gives
    the variant's k3 and its ratio to the base's with an interval, paired or not; the base's k3 and interval are
    the report's rollout against the base. The side the label expects higher comes first. `separates` when the
    ratio's interval excludes 1, either way: the knob moved k3 beyond the bootstrap's noise. Before the report
    has the entry (or for a variant the sweep did not finish) the numbers are None and the row never separates."""
    entries = results.get(SWEEP_RUN, {}).get("remedies") or []
    entry = next((e for e in entries if (e.get("side"), e.get("changed")) == (row.side, row.changed)), {})
    base = _vs_rollout(results, SWEEP_RUN, SWEEP_BASE)
    sides = [
        ([SWEEP_RUN, SWEEP_BASE], base.get("k3_kl"), base.get(ci_key("k3_kl"))),
        (_where(entry), entry.get("k3_kl"), entry.get(ci_key("k3_kl"))),
    ]
    (higher, high, high_ci), (lower, low, low_ci) = sides[::-1] if row.raises else sides
    ratio_ci = entry.get("ratio_ci95")
    return {
        "label": f"{row.name} vs the hf bf16 base",
        "key": RATIO,
        "name": row.name,
        "vary": row.vary,
        "higher": higher,
        "lower": lower,
        "higher_value": high,
        "higher_ci95": high_ci,
        "lower_value": low,
        "lower_ci95": low_ci,
        "ratio": entry.get(RATIO),
        "ratio_ci95": ratio_ci,
        "separates": bool(ratio_ci and (ratio_ci[0] > 1 or ratio_ci[1] < 1)),
    }


def _where(entry: dict) -> list | None:
    """[run folder, score set] of a remedies entry: its run is relative to the sweep's run ("." or a sibling)."""
    if not entry.get("run"):
        return None
    return [os.path.normpath(os.path.join(SWEEP_RUN, entry["run"])), entry.get("score_set")]


def effects_table(rows: list[dict]) -> Table:
    table = Table(title="demo effects: values with 95% bootstrap intervals over sequences")
    for name in ("effect", "higher side", "lower side", "significant"):
        table.add_column(name, justify="left" if name == "effect" else "right")
    for row in rows:
        table.add_row(effect_cell(row), *side_cells(row), "[green]yes[/]" if row["separates"] else "[red]no[/]")
    return table


def effect_cell(row: dict) -> str:
    """An effect as written in the terminal and the README: its label, and the number a row's significance rests
    on where it is not the two sides: a production rollout's share with its interval (`...: quant_share 86.0%
    [74.8%, 92.2%]`), a sweep variant's k3 ratio to the base (`...: k3 0.42× [0.33×, 0.53×]`)."""
    if row["key"] == RATIO:
        return f"{row['label']}: k3 {times(row['ratio'], row['ratio_ci95'])}"
    if "share" not in row:
        return row["label"]
    return f"{row['label']}: {row['key']} {percent(row['share'], row['share_ci95'])}"


def sweep_sentence(rows: list[dict]) -> str:
    """Which of the sweep's variants did not move k3 significantly, from the rows (printed after the table and
    written under it in the README)."""
    sweep = [row for row in rows if row["key"] == RATIO]
    unmeasured = [row["name"] for row in sweep if row["ratio"] is None]
    quiet = [row["name"] for row in sweep if row["ratio"] is not None and not row["separates"]]
    where = f"Of the sweep's variants (`{SWEEP_RUN}`, k3 over the hf bf16 base's)"
    if quiet:
        verb = "was" if len(quiet) == 1 else "were"
        said = [f"{where}, {_listed(quiet)} {verb} not significant: the ratio's interval includes 1."]
    elif len(unmeasured) < len(sweep):
        said = [f"{where}, every one measured moved k3 significantly: the ratio's interval excludes 1."]
    else:
        said = []
    if unmeasured:
        said.append(f"Not measured: {_listed(unmeasured)}.")
    return " ".join(said)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def side_cells(row: dict) -> tuple[str, str]:
    """An effect's higher and lower side as written in the terminal and the README: values with their
    intervals, or for a one-side effect its extreme tokens out of all."""
    high = with_interval(row["higher_value"], row["higher_ci95"])
    if "lower" in row:
        return high, with_interval(row["lower_value"], row.get("lower_ci95"))
    return high, f"{count(row['extreme_tokens'])} of {count(row['n_tokens'])} tokens"
