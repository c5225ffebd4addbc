"""metrics.json's `remedies`: what each variant of RUN/sweep.json (rundir/sweep.py) did to k3, and at what speed.

Each variant's k3 is against its own run's rollout; its ratio is that k3 over the base's (RUN's rollout
against the sweep's base score set), with a 95% interval:
- a training variant is a score set of RUN: the same tokens as the base, so the ratio's interval is the paired
  bootstrap of attribution's `paired_ratio` over the comparisons the report's pass computed;
- a rollout or both variant is a sibling run with tokens of its own: its k3 is read from its Parquet
  (frames/sequence_k3.py) and resampled with weights independent of RUN's (seed SIBLING_SEED: the same sample
  id in both runs is two independent draws), each run's sequences resampled alone; the interval is the
  percentiles of the per-resample ratio, as many resamples as every other interval.
speed_ratio compares the manifests' tokens_per_second, variant over base: the score sets' for a training
variant, the rollouts' (generation) for a rollout variant, and for both the two stages one after the other,
1 / (1/generate + 1/score), each in the tokens its stage counts. A variant whose sets are missing or unfinished
(an interrupted sweep) keeps its entry, numbers null, with a `note` saying what is missing.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import SEED, ci_key, interval
from mismatch_probe.frames.sequence_k3 import ResampledK3, resampled_k3, sequence_k3
from mismatch_probe.report.verdict.attribution import K3, Compared, paired_ratio
from mismatch_probe.rundir.layout import MANIFEST, ROLLOUT, SCORES, Run
from mismatch_probe.rundir.manifests import RUNNING
from mismatch_probe.rundir.sweep import BOTH_SIDES, SWEEP_FILE, TRAINING_SIDE, SweepFile, SweepVariant

SIBLING_SEED = SEED + 1  # a sibling run's resampling weights: independent of RUN's for the same sample ids


def load_sweep(run: Run) -> SweepFile | None:
    """RUN's sweep, its base checked to be a score set of RUN (before the report's long pass)."""
    sweep = SweepFile.load(run.root)
    if sweep is not None and sweep.base not in run.score_sets():
        known = ", ".join(run.score_sets()) or "none"
        raise ProbeError(
            f"{run.root / SWEEP_FILE}: base score set '{sweep.base}' not found in {run.root / SCORES} (score sets: {known})"
        )
    return sweep


def sweep_pairs(run: Run, sweep: SweepFile | None, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The report's pairs with the comparisons the remedies read from its pass: the rollout against the base and
    against each training variant's finished score set. One the sweep left unfinished is left out (its variant
    gets a note) rather than refused as any other unfinished score set is."""
    if sweep is None:
        return pairs
    names = set(run.score_sets())
    variants = [v.score_set for v in sweep.variants if v.paired and v.score_set in names]
    unfinished = {f"{SCORES}/{name}" for name in variants if run.score_manifest(name).status == RUNNING}
    wanted = [(ROLLOUT, f"{SCORES}/{name}") for name in [sweep.base, *variants]]
    return [p for p in dict.fromkeys(pairs + wanted) if not unfinished & set(p)]


def _missing(run: Run, variant: SweepVariant) -> str | None:
    """What an interrupted sweep left out of this variant's run, if anything (paths as sweep.json names them)."""
    where = "" if variant.paired else f"{variant.run}/"
    if not (run.root / MANIFEST).is_file():
        return f"run {variant.run} not found"
    if run.manifest().status == RUNNING:
        return f"{where}{ROLLOUT} unfinished"
    if variant.score_set not in run.score_sets():
        return f"{where}{SCORES}/{variant.score_set} not found"
    if run.score_manifest(variant.score_set).status == RUNNING:
        return f"{where}{SCORES}/{variant.score_set} unfinished"
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _combined(generate: float | None, score: float | None) -> float | None:
    """Tokens per second of generating then scoring, one stage after the other."""
    return 1.0 / (1.0 / generate + 1.0 / score) if generate and score else None


def speed_ratio(run: Run, sweep: SweepFile, variant: SweepVariant, sibling: Run) -> float | None:
    base_generate, base_score = run.manifest().tokens_per_second, run.score_manifest(sweep.base).tokens_per_second
    score = sibling.score_manifest(variant.score_set).tokens_per_second
    if variant.side == TRAINING_SIDE:
        return _ratio(score, base_score)
    generate = sibling.manifest().tokens_per_second
    if variant.side == BOTH_SIDES:
        return _ratio(_combined(generate, score), _combined(base_generate, base_score))
    return _ratio(generate, base_generate)


def significant(ci: list[float] | None) -> bool | None:
    """Whether the ratio's interval excludes 1 (no effect); None without an interval."""
    return None if ci is None else bool(ci[1] < 1.0 or ci[0] > 1.0)


def _entry(variant: SweepVariant, base: Compared) -> dict:
    return {
        "base": base.cand.side,
        "base_k3_kl": base.k3,
        "variant": variant.variant,
        "side": variant.side,
        "changed": dict(variant.changed),
        "run": variant.run,
        "score_set": variant.score_set,
        "paired": variant.paired,
    }


def _measured(base: Compared, variant: Compared | ResampledK3, speed: float | None) -> dict:
    if isinstance(variant, Compared):  # RUN's own tokens: resample i of both lines up
        n, k3, ci = variant.metrics.get("n_tokens"), variant.k3, variant.k3_ci
        ratio, resampled = paired_ratio(variant, base)
    else:
        n, k3, ci = variant.n_tokens, variant.k3, interval(variant.resampled)
        ratio = _ratio(variant.k3, base.k3)
        with np.errstate(divide="ignore", invalid="ignore"):
            resampled = variant.resampled / base.sequences.resampled_values(K3)
    ratio_ci = None if resampled is None else interval(resampled)
    return {
        "n_tokens": n,
        K3: k3,
        ci_key(K3): ci,
        "ratio": ratio,
        "ratio_ci95": ratio_ci,
        "significant": significant(ratio_ci),
        "speed_ratio": speed,
        "note": None,
    }


def _skipped(note: str) -> dict:
    numbers = ("n_tokens", K3, ci_key(K3), "ratio", "ratio_ci95", "significant", "speed_ratio")
    return dict.fromkeys(numbers) | {"note": note}


def remedies(run: Run, sweep: SweepFile | None, comparisons, comparison_json: list[dict]) -> list[dict] | None:
    """One entry per variant of the sweep, in its order; None for a run without sweep.json."""
    if sweep is None:
        return None
    infos = run.side_infos()
    compared = {
        (c.reference, c.candidate): Compared(
            ref=infos[c.reference], cand=infos[c.candidate], metrics=data["metrics"], sequences=c.sequences
        )
        for c, data in zip(comparisons, comparison_json)
    }
    base = compared[ROLLOUT, f"{SCORES}/{sweep.base}"]
    out = []
    for variant in sweep.variants:
        sibling = run if variant.paired else Run(sweep.run_of(run.root, variant))
        note = _missing(sibling, variant)
        if note is not None:
            out.append(_entry(variant, base) | _skipped(f"not measured: {note}"))
            continue
        side = f"{SCORES}/{variant.score_set}"
        if variant.paired:
            measured = compared[ROLLOUT, side]
        else:
            sibling.check_sides(sibling.manifest(), [side])
            measured = resampled_k3(sequence_k3(sibling, ROLLOUT, side), seed=SIBLING_SEED)
        out.append(_entry(variant, base) | _measured(base, measured, speed_ratio(run, sweep, variant, sibling)))
    return out
