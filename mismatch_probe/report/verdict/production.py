"""The shares of a production rollout (issue 40): how much of k3 its quantization and its truncated sampling
explain, measured as the routing share is with R3 (attribution.py).

- quant_share, for a rollout whose manifest records `quantization` (weight or act): 1 - k3(matched) / k3(plain),
  `plain` a training set of one engine, dtype and replay with `quantization` null, `matched` one of the same
  setup whose quantization weight and act are the rollout's matched pass (quant/served.py: an hf rollout's own
  schemes, a served rollout's mapped to hf's; a rescore with `--engine-arg weight_quant=... act_quant=...`, the
  trainer seeing the rollout's weights, as QAT does);
- truncation_share, for a rollout whose log-probs are truncated (logprobs_mode processed, or top_p < 1 or
  top_k > 0): `plain` a set scored raw, `matched` one scored with `probe rescore RUN --sampling rollout`
  (logprobs_mode processed: the rollout's top-p/top-k on the training logits, each side renormalised over its
  own support).
Plain and matched agree on everything else (engine, dtype, replay, and the other of the two settings); the
interval is the paired bootstrap of `paired_ratio`. A run whose rollout is neither has neither list: the
demo's metrics.json keeps its keys."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from mismatch_probe.frames.bootstrap import interval
from mismatch_probe.quant.served import (
    engine_args_text,
    is_matched,
    matched_pair,
    matched_quant_args,
    no_pass_reason,
    plain_args,
)
from mismatch_probe.report import numbers
from mismatch_probe.rundir.layout import INFERENCE, ROLLOUT, SCORES, TRAINING, Run
from mismatch_probe.vocab import NO_REPLAY, PROCESSED, RAW

QUANT_SHARE, TRUNCATION_SHARE = "quant_share", "truncation_share"


@dataclass(frozen=True)
class Production:
    """What one side's manifest says of quantization and sampling."""

    quantization: dict | None
    sampling: dict | None

    @property
    def quant(self) -> tuple | None:
        """(weight, act) of a quantized side; None when neither is."""
        q = self.quantization if isinstance(self.quantization, dict) else {}
        pair = (q.get("weight"), q.get("act"))
        return None if pair == (None, None) else pair

    @property
    def mode(self) -> str:
        s = self.sampling if isinstance(self.sampling, dict) else {}
        return s.get("logprobs_mode") or RAW

    @property
    def truncates(self) -> bool:
        """Log-probs over a truncated support: processed mode, or a top-p/top-k whose mode is not raw-declared."""
        s = self.sampling if isinstance(self.sampling, dict) else {}
        top_p, top_k = s.get("top_p"), s.get("top_k")
        truncated = (isinstance(top_p, (int, float)) and top_p < 1) or (isinstance(top_k, int) and top_k > 0)
        return self.mode == PROCESSED or truncated

    @property
    def production(self) -> bool:
        """Quantized (weights, activations or KV cache) or truncated: a side the report describes in full."""
        return isinstance(self.quantization, dict) or self.truncates

    def setup_line(self) -> str:
        """`weight fp8-block128, act fp8-token128, kv none; sampling T=1 top_p=0.7 top_k=0 processed`."""
        q = self.quantization
        quant = (
            ", ".join(f"{name} {q.get(name) or 'none'}" for name in ("weight", "act", "kv"))
            if isinstance(q, dict)
            else "not quantized"
        )
        s = self.sampling if isinstance(self.sampling, dict) else {}
        said = [f"{label}={s[key]:g}" for key, label in _SAMPLING if isinstance(s.get(key), (int, float))]
        if s.get("logprobs_mode"):
            said.append(str(s["logprobs_mode"]))
        return f"{quant}; sampling {' '.join(said)}" if said else f"{quant}; sampling not recorded"


_SAMPLING = (("temperature", "T"), ("top_p", "top_p"), ("top_k", "top_k"))


def productions(run: Run, sides) -> dict[str, Production]:
    """Each side's Production; a score set written before `sampling` was recorded scored raw at its temperature."""
    out = {}
    for side in sides:
        m = run.manifest() if side == ROLLOUT else run.score_manifest(side.removeprefix(f"{SCORES}/"))
        sampling = getattr(m, "sampling", None)
        if sampling is None and side != ROLLOUT and isinstance(getattr(m, "temperature", None), (int, float)):
            sampling = {"temperature": m.temperature, "logprobs_mode": RAW}
        out[side] = Production(quantization=getattr(m, "quantization", None), sampling=sampling)
    return out


def side_setups(run: Run) -> dict[str, str]:
    """Every side's setup line, where some side of the run is quantized or truncated; {} otherwise (a run like
    the demo's, whose sides all sample and score raw, unquantized)."""
    sides = [ROLLOUT] + [f"{SCORES}/{name}" for name in run.score_sets()]
    prods = productions(run, sides)
    if not any(p.production for p in prods.values()):
        return {}
    return {side: p.setup_line() for side, p in prods.items()}


def quantized_sides(run: Run) -> set[str]:
    """The sides whose manifest records weight or activation quantization (the bands judge their comparisons
    against a side that is not quantized by the quantized band)."""
    sides = [ROLLOUT] + [f"{SCORES}/{name}" for name in run.score_sets()]
    return {side for side, p in productions(run, sides).items() if p.quant is not None}


def _entries(compared, prods, paired_ratio, is_plain, is_matched, other) -> list[dict]:
    by_setup: dict[tuple, dict[str, object]] = {}
    for c in compared:
        # not attribution's `canonical` sides: a plain and a matched set share engine, dtype and replay
        if c.ref.role != INFERENCE or c.cand.role != TRAINING or not c.cand.complete or c.cand.policy is not None:
            continue
        p = prods[c.cand.side]
        kind = "plain" if is_plain(p) else "matched" if is_matched(p) else None
        if kind is not None:
            found = by_setup.setdefault((c.ref.side, c.cand.engine, c.cand.dtype, c.cand.replay, other(p)), {})
            if kind not in found or c.cand.rank < found[kind].cand.rank:  # the unrepeated set, else pass 1
                found[kind] = c
    out = []
    for (reference, engine, dtype, replay, _), found in by_setup.items():
        plain, matched = found.get("plain"), found.get("matched")
        if plain is None or matched is None:
            continue
        ratio, resampled = paired_ratio(matched, plain)
        out.append(
            {
                "reference": reference,
                "engine": engine,
                "role": TRAINING,
                "dtype": dtype,
                "replay": replay,
                "plain": plain.cand.side,
                "matched": matched.cand.side,
                "k3_kl_plain": plain.k3,
                "k3_kl_plain_ci95": plain.k3_ci,
                "k3_kl_matched": matched.k3,
                "k3_kl_matched_ci95": matched.k3_ci,
                "share": None if ratio is None else 1.0 - ratio,
                "share_ci95": None if resampled is None else interval(1.0 - resampled),
            }
        )
    return out


def production_shares(run: Run, compared, paired_ratio) -> dict[str, list[dict]]:
    """{quant_share: [...]} for a quantized rollout, {truncation_share: [...]} for a truncated one (each
    possibly empty: its missing line says which pass would fill it); {} for any other rollout.
    paired_ratio: attribution's (k3(num) / k3(den) and its paired resamples)."""
    sides = {ROLLOUT} | {s for c in compared for s in (c.ref.side, c.cand.side)}
    prods = productions(run, sorted(sides))
    rollout = prods[ROLLOUT]
    out: dict[str, list[dict]] = {}
    if rollout.quant is not None:
        target = matched_pair(rollout.quantization, run.manifest().model)  # None: no known matched pass
        entries = _entries(
            compared,
            prods,
            paired_ratio,
            is_plain=lambda p: p.quant is None,
            is_matched=lambda p: is_matched(p.quant, target),
            other=lambda p: p.mode,
        )
        out[QUANT_SHARE] = [e | {"weight": rollout.quant[0], "act": rollout.quant[1]} for e in entries]
    if rollout.truncates:
        out[TRUNCATION_SHARE] = _entries(
            compared,
            prods,
            paired_ratio,
            is_plain=lambda p: p.mode == RAW,
            is_matched=lambda p: p.mode == PROCESSED,
            other=lambda p: p.quant,
        )
    return out


def what_quantized(weight, act) -> str:
    """`weight quantization (fp8-block128)`, `weight and activation quantization (fp8-block128, fp8-token128)`."""
    if weight and act:
        return f"weight and activation quantization ({weight}, {act})"
    return f"weight quantization ({weight})" if weight else f"activation quantization ({act})"


def share_sentence(name: str, e: dict) -> str:
    what = what_quantized(e["weight"], e["act"]) if name == QUANT_SHARE else "truncated sampling (top-p/top-k)"
    matched = "the rollout's quantization" if name == QUANT_SHARE else "--sampling rollout: the rollout's truncation"
    replayed = "" if e["replay"] == NO_REPLAY else f" with {e['replay'].upper()} replay"
    return (
        f"{what[:1].upper() + what[1:]} explains {numbers.percent(e['share'], e['share_ci95'])} of k3 between "
        f"{e['reference']} and {e['engine']} training at {e['dtype']}{replayed}: k3 "
        f"{numbers.with_interval(e['k3_kl_plain'], e['k3_kl_plain_ci95'])} against {e['plain']}, "
        f"{numbers.with_interval(e['k3_kl_matched'], e['k3_kl_matched_ci95'])} against {e['matched']} "
        f"({matched} on the training side)."
    )


def share_headlines(entries: dict) -> list[str]:
    return [share_sentence(name, e) for name in (QUANT_SHARE, TRUNCATION_SHARE) for e in entries.get(name) or []]


def missing_share_lines(run: Run, entries: dict, engine: str, dtype: str) -> list[str]:
    """The pass that would measure each share the rollout calls for but the run lacks."""
    root = shlex.quote(str(run.root))
    lines = []
    if QUANT_SHARE in entries and not entries[QUANT_SHARE]:
        rollout = productions(run, [ROLLOUT])[ROLLOUT]
        weight, act = rollout.quant
        matched = matched_quant_args(rollout.quantization, run.manifest().model)
        if matched is None:  # a served scheme hf has no pass for: say so, never suggest one the engine refuses
            lines.append(f"quant_share: {no_pass_reason(rollout.quantization)}")
        else:
            args = engine_args_text({key: shlex.quote(value) for key, value in matched.items()})
            plain = engine_args_text(plain_args(run.manifest().model))  # an FP8 checkpoint: its weights, plainly
            lines.append(
                f"add `probe rescore {root} --engine {engine} --dtype {dtype}{args} --name {engine}-{dtype}-quant` (and a "
                f"plain `probe rescore {root} --engine {engine} --dtype {dtype}{plain}` where the run has none) for the share of k3 the rollout's "
                f"{what_quantized(weight, act)} explains (k3 with against without it on the training side)"
            )
    if TRUNCATION_SHARE in entries and not entries[TRUNCATION_SHARE]:
        lines.append(
            f"add `probe rescore {root} --engine {engine} --dtype {dtype} --sampling rollout --name {engine}-{dtype}-sampled` (and a "
            f"plain `probe rescore {root} --engine {engine} --dtype {dtype}` where the run has none) for the share of k3 the rollout's truncated "
            "sampling explains (the same top-p/top-k on both sides against raw log-probs)"
        )
    return lines
