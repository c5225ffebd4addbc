"""Attribution: where a run's mismatch comes from, from the comparisons the report computed.

Four kinds of entry, each built only where the run has the sides for it:
- noise_floor: pass against pass of repeated passes of one engine, dtype and replay;
- routing_share: for one reference, the same engine and dtype with and without R3 replay,
  share = 1 - k3(R3) / k3(no R3), its interval from a paired bootstrap (see `paired_ratio`);
- numerics (metrics.json's name for the error split): var(delta) of a comparison split into each side's
  error against an fp32 score set (accumulated in the report's streaming pass, accumulators/error_split.py);
- engine_gap: k3 between sides of different engines at the same dtype and replay, and its ratio to the
  matching noise floor.
Each entry becomes a headline sentence; absent statements become `missing` lines (attribution_text.py).
Policy comparisons (a new policy's pass against its θ_old set) are left out: a routing share or engine gap
between two checkpoints' passes would be the policy's move, not the engines' mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.frames.bootstrap import ci_key, interval
from mismatch_probe.report.accumulators.error_split import ErrorSplitAccumulator
from mismatch_probe.report.accumulators.sequence_stats import SequenceStats
from mismatch_probe.report.policy.kind import is_policy
from mismatch_probe.report.verdict.attribution_text import headlines, missing_lines
from mismatch_probe.report.verdict.decode import decode_entries, decode_headlines
from mismatch_probe.report.verdict.production import missing_share_lines, production_shares, share_headlines
from mismatch_probe.rundir.layout import ROLLOUT, TRAINING, Run, SideInfo
from mismatch_probe.vocab import FP32, NO_REPLAY

K3 = "k3_kl"


@dataclass
class Compared:
    """One comparison as attribution reads it: its sides, its metrics and its streaming accumulators."""

    ref: SideInfo
    cand: SideInfo
    metrics: dict
    sequences: SequenceStats | None = None
    error_split: ErrorSplitAccumulator | None = None
    profile: dict | None = None  # mean |delta| by position and its onset (accumulators/position_profile.py)

    @property
    def k3(self) -> float | None:
        return self.metrics.get(K3)

    @property
    def k3_ci(self) -> list[float] | None:
        return self.metrics.get(ci_key(K3))

    def sides(self) -> dict:
        return {"reference": self.ref.side, "candidate": self.cand.side}


def canonical(infos) -> set[str]:
    """One side per setup (role, engine, dtype, replay): the unrepeated one, else the first pass, so that
    a repeated pass does not repeat every statement made about its setup."""
    best: dict[tuple, SideInfo] = {}
    for info in infos:
        if info.complete and (info.setup not in best or info.rank < best[info.setup].rank):
            best[info.setup] = info
    return {info.side for info in best.values()}


def _fp32_side(ref: SideInfo, cand: SideInfo, infos: dict[str, SideInfo], chosen: set[str]) -> str | None:
    """An fp32 score set without replay that is neither side, preferring the candidate's engine."""
    options = [
        i
        for i in infos.values()
        if i.role == TRAINING
        and i.dtype == FP32
        and i.replay == NO_REPLAY
        and i.side in chosen
        and i.side not in (ref.side, cand.side)
    ]
    options.sort(key=lambda i: (i.engine != cand.engine, i.engine != ref.engine, i.side))
    return options[0].side if options else None


def error_split_plan(run: Run, pairs) -> dict[tuple[str, str], str]:
    """{(reference, candidate): fp32 side} for the comparisons whose variance is split per side: both sides
    without replay, each standing for its setup, neither in fp32 (an fp32 side's error against another fp32
    set is the engine gap, stated on its own)."""
    infos = run.side_infos()
    chosen = canonical(infos.values())
    plan = {}
    for reference, candidate in pairs:
        ref, cand = infos[reference], infos[candidate]
        plain = ref.replay == cand.replay == NO_REPLAY and FP32 not in (ref.dtype, cand.dtype)
        if plain and {reference, candidate} <= chosen:
            fp32 = _fp32_side(ref, cand, infos, chosen)
            if fp32 is not None:
                plan[reference, candidate] = fp32
    return plan


def paired_ratio(num: Compared, den: Compared) -> tuple[float | None, np.ndarray | None]:
    """k3(num) / k3(den) and its value in each bootstrap resample. Both comparisons cover the run's
    sequences, whose Poisson weights depend only on (seed, sample_id, resample): resample i of one lines
    up with resample i of the other, so the ratio's spread leaves out what the two share."""
    if num.k3 is None or not den.k3:
        return None, None
    point = num.k3 / den.k3
    if num.sequences is None or den.sequences is None:
        return point, None
    with np.errstate(divide="ignore", invalid="ignore"):
        return point, num.sequences.resampled_values(K3) / den.sequences.resampled_values(K3)


def noise_floors(compared: list[Compared]) -> list[tuple[dict, Compared]]:
    out = []
    for c in compared:
        group = c.ref.repeat_group
        repeated = group is not None and group == c.cand.repeat_group and c.ref.setup == c.cand.setup
        if repeated and c.ref.role == c.cand.role == TRAINING:
            entry = {
                **c.sides(),
                "engine": c.ref.engine,
                "role": c.ref.role,
                "dtype": c.ref.dtype,
                "replay": c.ref.replay,
                "repeat_group": group,
                "n_tokens": c.metrics.get("n_tokens"),
                K3: c.k3,
                ci_key(K3): c.k3_ci,
            }
            out.append((entry, c))
    return out


def routing_shares(compared: list[Compared], chosen: set[str]) -> list[dict]:
    by_setup: dict[tuple, dict[str, Compared]] = {}
    for c in compared:
        if c.cand.role == TRAINING and c.cand.side in chosen and c.ref.side != c.cand.side:
            by_setup.setdefault((c.ref.side, c.cand.engine, c.cand.dtype), {})[c.cand.replay] = c
    out = []
    for (reference, engine, dtype), by_replay in by_setup.items():
        without = by_replay.get(NO_REPLAY)
        for replay, with_replay in by_replay.items():
            if replay == NO_REPLAY or without is None:
                continue
            ratio, resampled = paired_ratio(with_replay, without)
            share = None if ratio is None else 1.0 - ratio
            out.append(
                {
                    "reference": reference,
                    "engine": engine,
                    "role": TRAINING,
                    "dtype": dtype,
                    "replay": replay,
                    "without_replay": without.cand.side,
                    "with_replay": with_replay.cand.side,
                    "k3_kl_without_replay": without.k3,
                    "k3_kl_without_replay_ci95": without.k3_ci,
                    "k3_kl_with_replay": with_replay.k3,
                    "k3_kl_with_replay_ci95": with_replay.k3_ci,
                    "share": share,
                    "share_ci95": None if resampled is None else interval(1.0 - resampled),
                }
            )
    return out


def error_split_entries(compared: list[Compared]) -> list[dict]:
    return [{**c.sides(), "fp32": c.error_split.fp32_side} | c.error_split.result() for c in compared if c.error_split]


def engine_gaps(compared: list[Compared], chosen: set[str], floors: list[tuple[dict, Compared]]) -> list[dict]:
    out = []
    for c in compared:
        ref, cand = c.ref, c.cand
        same_engine = (ref.role, ref.engine) == (cand.role, cand.engine)
        if same_engine or not ref.dtype or ref.dtype != cand.dtype or ref.replay != cand.replay:
            continue
        if not {ref.side, cand.side} <= chosen:
            continue
        engines = {(ref.role, ref.engine), (cand.role, cand.engine)}
        matching = [
            (e, f)
            for e, f in floors
            if (f.ref.role, f.ref.engine) in engines
            and f.ref.dtype == ref.dtype
            and f.ref.replay == ref.replay
            and f.k3 is not None
        ]
        # The largest matching floor: the gap is stated against the noisier engine's own spread.
        floor = max(matching, key=lambda ef: ef[1].k3, default=None)
        ratio, resampled = paired_ratio(c, floor[1]) if floor else (None, None)
        out.append(
            {
                **c.sides(),
                "engine_ref": ref.engine,
                "role_ref": ref.role,
                "engine_cand": cand.engine,
                "role_cand": cand.role,
                "dtype": ref.dtype,
                "replay": ref.replay,
                "n_tokens": c.metrics.get("n_tokens"),
                K3: c.k3,
                ci_key(K3): c.k3_ci,
                "noise_floor": None
                if floor is None
                else {key: floor[0][key] for key in ("reference", "candidate", "engine", "role", K3, ci_key(K3))},
                "ratio_to_noise_floor": ratio,
                "ratio_to_noise_floor_ci95": None if resampled is None else interval(resampled),
            }
        )
    return out


def attribute(run: Run, comparisons, comparison_json: list[dict], request=None) -> dict:
    """metrics.json's `attribution`: headlines, missing lines and the four lists of entries."""
    infos = run.side_infos()
    compared = [
        Compared(
            ref=infos[c.reference],
            cand=infos[c.candidate],
            metrics=data["metrics"],
            sequences=c.sequences,
            error_split=c.error_split,
            profile=data.get("position_profile"),
        )
        for c, data in zip(comparisons, comparison_json)
        if not is_policy(data)
    ]
    involved = {side for c in compared for side in (c.ref.side, c.cand.side)}
    chosen = canonical(infos[side] for side in involved)
    floors = noise_floors(compared)
    entries = {
        "noise_floor": [entry for entry, _ in floors],
        "routing_share": routing_shares(compared, chosen),
        "numerics": error_split_entries(compared),
        "engine_gap": engine_gaps(compared, chosen, floors),
    }
    manifest = run.manifest()
    keeps_defaults = request is None or request.default_pairs  # a report that names its own pairs: see missing_lines
    missing = missing_lines(run.root, infos, compared, entries, manifest.routing.is_moe, keeps_defaults)
    shares = production_shares(run, compared, paired_ratio)  # {} unless the rollout is quantized or truncated
    training = [i for i in infos.values() if i.role == TRAINING and i.policy is None]
    engine = training[0].engine if training else "hf"
    missing += missing_share_lines(run, shares, engine, infos[ROLLOUT].dtype or "bf16")
    if manifest.model is None:  # an imported or recorded run: `probe rescore` needs the model it does not name
        missing = [f"more score sets need the model, which {run.root} does not name (imported or recorded)"]
    decode = decode_entries(run, compared, chosen, paired_ratio)  # {} unless the run has an engine-prefill set
    return (
        {
            "headlines": share_headlines(shares) + decode_headlines(decode) + headlines(entries),
            "missing": missing,
        }
        | entries
        | shares
        | decode
    )
