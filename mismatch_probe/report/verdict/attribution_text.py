"""The sentences of `attribution`: one headline per entry, built from its numbers, and one `missing` line
per statement the run lacks the sides for, naming the command that would add them. A command that
reports prints the run's last report plus the change (report_request.report_command)."""

from __future__ import annotations

import shlex
from itertools import combinations
from pathlib import Path

from mismatch_probe.report import numbers
from mismatch_probe.report.keys.request import report_command
from mismatch_probe.rundir.layout import ROLLOUT, SCORES, default_score_name, pass_names
from mismatch_probe.vocab import (  # lowest precision first: where noise shows most
    BF16,
    FP32,
    NO_REPLAY,
    PRECISION_ORDER,
)


def percent(value, ci=None) -> str:
    """`82.4% [75.1%, 88.0%]`; `—` when undefined."""
    return numbers.percent(value, ci)


def times(value, ci=None) -> str:
    """`180× [150×, 210×]`."""
    return numbers.times(value, ci)


def _setup(engine: str, role: str, dtype, replay: str) -> str:
    replayed = "" if replay == NO_REPLAY else f" with {replay.upper()} replay"
    return f"{engine} {role} at {dtype or 'unknown dtype'}{replayed}"


def noise_floor_sentence(e: dict) -> str:
    return (
        f"Noise floor of {_setup(e['engine'], e['role'], e['dtype'], e['replay'])}: repeated passes differ by "
        f"k3 = {numbers.with_interval(e['k3_kl'], e['k3_kl_ci95'])} ({e['reference']} vs {e['candidate']}, "
        f"{numbers.count(e['n_tokens'])} tokens)."
    )


def routing_share_sentence(e: dict) -> str:
    return (
        f"Routing-induced share of the mismatch between {e['reference']} and "
        f"{_setup(e['engine'], e['role'], e['dtype'], NO_REPLAY)}: {percent(e['share'], e['share_ci95'])} "
        f"(k3 {numbers.with_interval(e['k3_kl_without_replay'], e['k3_kl_without_replay_ci95'])} without "
        f"{e['replay'].upper()}, {e['without_replay']}; "
        f"{numbers.with_interval(e['k3_kl_with_replay'], e['k3_kl_with_replay_ci95'])} with it, "
        f"{e['with_replay']})."
    )


def error_split_sentence(e: dict) -> str:
    """Each side's own error against fp32, and which is larger. var(delta) = var_ref + var_cand - 2 cov:
    errors both sides share (the same bf16 weights, say) cancel in delta, so the parts may exceed it."""
    if e["var_delta"] is None:
        return (
            f"Numerical error against {e['fp32']}, {e['reference']} vs {e['candidate']}: no token finite on all three."
        )
    larger = e["reference"] if e["var_ref"] >= e["var_cand"] else e["candidate"]
    corr = "" if e["correlation"] is None else f"; the two errors correlate at {numbers.value(e['correlation'])}"
    return (
        f"Numerics, {e['reference']} vs {e['candidate']} (each against fp32 {e['fp32']}, "
        f"{numbers.count(e['n_tokens'])} tokens): {larger} carries the larger error. Error variance: "
        f"{e['reference']} {numbers.value(e['var_ref'])}, {e['candidate']} {numbers.value(e['var_cand'])}{corr}; "
        f"var(delta) {numbers.value(e['var_delta'])}."
    )


def engine_gap_sentence(e: dict) -> str:
    text = (
        f"Engine gap, {e['engine_ref']} {e['role_ref']} vs {e['engine_cand']} {e['role_cand']} at "
        f"{e['dtype']}{'' if e['replay'] == NO_REPLAY else ' with ' + e['replay'].upper() + ' replay'}: "
        f"k3 = {numbers.with_interval(e['k3_kl'], e['k3_kl_ci95'])} "
        f"({e['reference']} vs {e['candidate']})"
    )
    floor = e["noise_floor"]
    if floor is not None:
        text += (
            f", {times(e['ratio_to_noise_floor'], e['ratio_to_noise_floor_ci95'])} the noise floor of "
            f"{floor['engine']} {floor['role']} ({floor['reference']} vs {floor['candidate']})"
        )
    return text + "."


def headlines(entries: dict) -> list[str]:
    """The effects first (routing, error split, engines); the noise floor they are measured against last."""
    sentences = [routing_share_sentence(e) for e in entries["routing_share"]]
    sentences += [error_split_sentence(e) for e in entries["numerics"]]
    sentences += [engine_gap_sentence(e) for e in entries["engine_gap"]]
    return sentences + [noise_floor_sentence(e) for e in entries["noise_floor"]]


def _lowest_precision(dtypes) -> str:
    known = [d for d in dtypes if d in PRECISION_ORDER]
    return min(known, key=PRECISION_ORDER.index) if known else BF16


def missing_lines(
    root: Path, infos: dict, compared: list, entries: dict, is_moe: bool, keeps_defaults: bool = True
) -> list[str]:
    """One line per statement the run cannot make, with the command that would make it possible.
    keeps_defaults: the report compares the default pairs, so a new score set joins the next plain
    `probe report RUN`; otherwise each rescore line also says which pairs to add."""
    rescore = _RescoreHint(root, keeps_defaults)
    training = [info for c in compared for info in (c.ref, c.cand) if info.role == "training"]
    engines = list(dict.fromkeys(info.engine for info in training))
    dtype_of = {engine: _lowest_precision(i.dtype for i in training if i.engine == engine) for engine in engines}
    lines = []
    floored = {e["engine"] for e in entries["noise_floor"]}
    lines += [
        f"add {rescore(engine, dtype_of[engine], repeats=2)} for the noise "
        f"floor of {engine} training at {dtype_of[engine]} (pass against pass)"
        for engine in engines
        if engine not in floored
    ]
    if is_moe:
        shared = {e["engine"] for e in entries["routing_share"]}
        lines += [
            f"add {rescore(engine, dtype_of[engine], replay='r3')} for the "
            f"routing-induced share of {engine} training at {dtype_of[engine]} (k3 with against without R3)"
            for engine in engines
            if engine not in shared
        ]
    lines += _missing_error_split(rescore, infos, engines, entries)
    return lines + _missing_engine_gaps(root, rescore, infos, compared, engines, entries)


class _RescoreHint:
    """`probe rescore RUN --engine E --dtype D ...`, then, for a report whose pairs replace the defaults,
    the `probe report` that adds the new score sets' pairs (rollout against each, pass against pass)."""

    def __init__(self, root: Path, keeps_defaults: bool):
        self.root, self.keeps_defaults = root, keeps_defaults

    def __call__(self, engine: str, dtype: str, replay: str = NO_REPLAY, repeats: int = 1) -> str:
        flags = (f" --repeats {repeats}" if repeats > 1 else "") + (
            f" --replay {replay}" if replay != NO_REPLAY else ""
        )
        text = f"`probe rescore {shlex.quote(str(self.root))} --engine {engine} --dtype {dtype}{flags}`"
        if self.keeps_defaults:
            return text
        sides = [f"{SCORES}/{name}" for name in pass_names(default_score_name(engine, dtype, replay), repeats)]
        pairs = [(ROLLOUT, side) for side in sides] + list(zip(sides, sides[1:]))
        return f"{text}, then `{report_command(self.root, pairs)}`"


def _missing_error_split(rescore: _RescoreHint, infos: dict, engines: list[str], entries: dict) -> list[str]:
    if entries["numerics"]:
        return []
    engine = engines[0] if engines else "hf"
    plain = [i for i in infos.values() if i.role == "training" and i.replay == NO_REPLAY and i.complete]
    if not any(i.dtype == FP32 for i in plain):
        return [
            f"add {rescore(engine, FP32)} to split each comparison's "
            "variance of delta into each side's error against fp32"
        ]
    if all(i.dtype == FP32 for i in plain):
        return [
            f"add {rescore(engine, 'bf16')} for a comparison whose variance of "
            "delta splits into each side's error against fp32"
        ]
    return []


def _missing_engine_gaps(
    root: Path, rescore: _RescoreHint, infos: dict, compared: list, engines: list[str], entries: dict
) -> list[str]:
    lines = []
    if not entries["engine_gap"]:
        rollout = infos["rollout"]
        dtype = rollout.dtype or "DTYPE"
        lines.append(
            f"add {rescore(engines[0] if engines else 'hf', dtype)} for the "
            f"gap between the rollout's engine ({rollout.engine} inference) and a training engine at "
            "the same dtype"
        )
    done = {frozenset((c.ref.side, c.cand.side)) for c in compared}
    gapped = {frozenset((e["reference"], e["candidate"])) for e in entries["engine_gap"]}
    plain = sorted(
        (
            i
            for i in infos.values()
            if i.role == "training" and i.replay == NO_REPLAY and i.complete and not i.repeat_group
        ),
        key=lambda i: i.side,
    )
    for a, b in combinations(plain, 2):
        pair = frozenset((a.side, b.side))
        if a.engine != b.engine and a.dtype and a.dtype == b.dtype and pair not in done | gapped:
            lines.append(
                f"run `{report_command(root, [(a.side, b.side)])}` for the gap "
                f"between {a.engine} and {b.engine} training at {a.dtype}"
            )
    return lines
