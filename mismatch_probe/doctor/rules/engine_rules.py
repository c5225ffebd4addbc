"""The rules of the second round of checks (checks/engine_bugs.py), from their streamed sums to findings.

Margins sit between what clean runs show and what the planted faults show (docs/doctor.md has both).
"""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.doctor.checks import engine_bugs as C
from mismatch_probe.doctor.stats.duplicates import RARE_CHANCE, too_many_twins
from mismatch_probe.doctor.stats.onset import find_onset
from mismatch_probe.doctor.stats.transport import FLAT_SHARE, TRANSPORT_FACTOR, TRANSPORT_FLOOR, cumulative_fit
from mismatch_probe.report.numbers import with_interval

# routes_constant: a layer whose ids sit on its k most used experts for (nearly) every token, where the
# other side's same layer spreads; clean layers of the demo keep 0.33-0.44 of their ids on their top k.
CONSTANT_SHARE = 0.9
VARY_MARGIN = 0.2  # the other side's share is at least this much lower
# layer_routes_outlier: clean per-layer router disagreement is 0.1-1.4 %, so ratios between layers reach 3x;
# an outlier is 5x the other layers' median and 10 percentage points above it.
OUTLIER_RATIO = 5.0
OUTLIER_MARGIN = 0.10


def _layers(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)


def constant_layers(route: dict[str, dict], pairs) -> dict[str, list[int]]:
    """Per side, the MoE layers whose routes are constant where the other side of some comparison varies."""
    found: dict[str, set[int]] = {}
    for ref, cand in pairs:
        if ref not in route or cand not in route or not route[ref]["rows_checked"] or not route[cand]["rows_checked"]:
            continue
        a, b = np.array(route[ref]["top_set_share"]), np.array(route[cand]["top_set_share"])
        for side, mine, other in ((ref, a, b), (cand, b, a)):
            layers = np.flatnonzero((mine >= CONSTANT_SHARE) & (other <= mine - VARY_MARGIN))
            found.setdefault(side, set()).update(int(x) for x in layers)
    return {side: sorted(layers) for side, layers in found.items() if layers}


def routes_constant(diagnosis, route: dict[str, dict], constant: dict[str, list[int]], model_layers) -> None:
    for side, layers in constant.items():
        r = route[side]
        zeros = [i for i in layers if r["zero_share"][i] >= CONSTANT_SHARE]
        shares = [round(r["top_set_share"][i], 4) for i in layers]
        diagnosis.add(
            C.ROUTES_CONSTANT,
            side,
            f"{side}: MoE layer(s) {_layers(layers)} (model layer(s) {_layers([model_layers[i] for i in layers])}) "
            f"route every token to the same experts ({', '.join(f'{s:.1%}' for s in shares)} of ids on the layer's "
            f"top-k set" + (f"; all zeros in {_layers(zeros)}" if zeros else "") + ") while the other side's routes "
            "vary",
            {
                "side": side,
                "layers": layers,
                "model_layers": [model_layers[i] for i in layers],
                "top_set_share": shares,
                "all_zero_layers": zeros,
                "rows_checked": r["rows_checked"],
            },
        )


def routes_invalid(
    diagnosis, route: dict[str, dict], constant: dict[str, list[int]], top_k: int, experts: int
) -> dict[str, list[int]]:
    """Names each side's invalid routes; returns its layers with invalid ids (the outlier rule leaves them out:
    the invalid ids explain their disagreement)."""
    layers: dict[str, list[int]] = {}
    for side, r in route.items():
        skip = set(constant.get(side, []))
        out = {i: n for i, n in enumerate(r["out_of_range_rows"]) if n and i not in skip}
        repeated = {i: n for i, n in enumerate(r["repeated_rows"]) if n and i not in skip}
        # rows of zeros in every layer; when every layer is constant, that is routes_constant's finding alone
        holes = r["zero_filled_rows"] if len(skip) < len(r["repeated_rows"]) else 0
        if not (out or repeated or holes):
            continue
        layers[side] = sorted(set(out) | set(repeated))
        parts, kinds = [], []
        if out:
            sample, position, layer, bad = r["first_out_of_range"]
            kinds.append("out_of_range")
            parts.append(
                f"{sum(out.values())} (token, layer) routes hold an expert id >= the model's {experts} experts, in "
                f"MoE layer(s) {_layers(sorted(out))} (first: sample {sample} position {position} layer {layer} "
                f"id {bad}): unmapped physical ids, e.g. EPLB replicas"
            )
        if repeated:
            kinds.append("repeated_id")
            parts.append(
                f"{sum(repeated.values())} of {r['rows_checked']} checked tokens list one expert twice in their "
                f"top-{top_k}, in MoE layer(s) {_layers(sorted(repeated))}"
            )
        if holes:
            kinds.append("zero_filled")
            parts.append(
                f"{holes} of {r['rows_checked']} checked tokens hold only zeros in every MoE layer: holes filled "
                "with zeros (prefix cache, prefill/decode disaggregation)"
            )
        diagnosis.add(
            C.ROUTES_INVALID,
            side,
            f"{side}: " + "; ".join(parts),
            {
                "side": side,
                "kinds": kinds,
                "out_of_range_rows": {str(i): n for i, n in out.items()},
                "repeated_id_rows": {str(i): n for i, n in repeated.items()},
                "zero_filled_rows": holes,
                "rows_checked": r["rows_checked"],
                "num_experts": experts,
                "first_out_of_range": r["first_out_of_range"] if out else None,
            },
        )
    return layers


def layer_outlier(diagnosis, label: str, layers: dict, skip: set[int], model_layers) -> bool:
    rows = layers["rows"]
    if rows < 20 or len(layers["diffs"]) < 2:
        return False
    rates = np.array(layers["diffs"], dtype=np.float64) / rows
    usable = [i for i in range(len(rates)) if i not in skip]
    flagged = []
    for i in usable:
        others = [rates[j] for j in usable if j != i]
        if not others:
            continue
        median = float(np.median(others))
        if rates[i] >= OUTLIER_RATIO * median and rates[i] - median >= OUTLIER_MARGIN:
            flagged.append((i, median))
    if not flagged:
        return False
    first = flagged[0][0] == 0
    diagnosis.add(
        C.LAYER_ROUTES_OUTLIER,
        label,
        f"{label}: MoE layer(s) {_layers([i for i, _ in flagged])} disagree on "
        + ", ".join(f"{rates[i]:.1%}" for i, _ in flagged)
        + " of tokens against a median of "
        + ", ".join(f"{m:.2%}" for _, m in flagged)
        + " over the other layers"
        + (": the first MoE layer, the MTP/draft-router signature" if first else ""),
        {
            "layers": [i for i, _ in flagged],
            "model_layers": [model_layers[i] for i, _ in flagged],
            "rates": [float(rates[i]) for i, _ in flagged],
            "median_other_layers": [m for _, m in flagged],
            "per_layer_rates": rates.tolist(),
            "tokens": int(rows),
            "draft_signature": first,
        },
    )
    return True


def position_onset(diagnosis, label: str, sums: np.ndarray) -> bool:
    if sums.shape[1] < 2:
        return False
    onset = find_onset(sums)
    if onset is None:
        return False
    before, after = onset["before"], onset["after"]
    ratio = onset["ratio"]
    diagnosis.add(
        C.POSITION_ONSET,
        label,
        f"{label}: mean |delta| is {with_interval(before['mean_abs_delta'], before['ci95'])} "
        f"before position {onset['onset_position']} and {with_interval(after['mean_abs_delta'], after['ci95'])} "
        "from it on ("
        + (f"{ratio:.1f}x" if math.isfinite(ratio) else "bitwise equal before")
        + f", {onset['z']:.0f} standard errors): a step at a fixed position, as an fp8 KV cache or an attention "
        "kernel's tile size makes",
        {
            "onset_position": onset["onset_position"],
            "before": before,
            "after": after,
            "ratio": ratio if math.isfinite(ratio) else None,
            "z": onset["z"],
        },
    )
    return True


def cumulative(diagnosis, ref: str, cand: str, s: dict, runs: dict[str, dict], min_tokens: int) -> bool:
    """The side whose log-probs fit running sums, or chunk totals, of the other side's far better than they
    fit its values: named once, whichever comparison shows it."""
    for role, side, other in (("ref", ref, cand), ("cand", cand, ref)):
        fit = cumulative_fit(s, role)
        if fit and fit[2] >= min_tokens and fit[1] >= TRANSPORT_FLOOR and fit[0] * TRANSPORT_FACTOR <= fit[1]:
            diagnosis.add(
                C.CUMULATIVE_LOGPROBS,
                side,
                f"{side}: its log-probs are running sums of {other}'s: row p+1 minus row p is {other}'s row p+1 "
                f"to {fit[0]:.3g} nats on average, while the stored values differ by {fit[1]:.3g}",
                {"side": side, "form": "running_sums", "fit_error": fit[0], "stored_error": fit[1], "n_pairs": fit[2]},
            )
            return True
        t = runs[role]
        if t["tokens"] < min_tokens:
            continue
        stored, fitted, share = t["stored"] / t["tokens"], t["fit"] / t["tokens"], t["flat_tokens"] / t["tokens"]
        if stored >= TRANSPORT_FLOOR and fitted * TRANSPORT_FACTOR <= stored and share >= FLAT_SHARE:
            runs_mean = t["flat_tokens"] / max(t["flat_runs"], 1)
            diagnosis.add(
                C.CUMULATIVE_LOGPROBS,
                side,
                f"{side}: its log-probs are flat over runs of {runs_mean:.1f} tokens ({share:.0%} of tokens) whose "
                f"totals match {other}'s to {fitted:.3g} nats per token, while the stored values differ by "
                f"{stored:.3g}: each stream chunk's total spread over its tokens",
                {
                    "side": side,
                    "form": "chunk_totals",
                    "fit_error": fitted,
                    "stored_error": stored,
                    "flat_token_share": share,
                    "mean_chunk_tokens": runs_mean,
                    "n_tokens": int(t["tokens"]),
                },
            )
            return True
    return False


def duplicates(diagnosis, rollout: str, d: dict, temperature: float | None) -> None:
    if not d or temperature == 0 or not too_many_twins(d):
        return
    at = "the recorded temperature" if temperature is None else f"temperature {temperature:g}"
    diagnosis.add(
        C.DUPLICATE_SAMPLES,
        rollout,
        f"{rollout}: {d['twins']} of {d['n_samples']} samples repeat another sample's response of the same prompt "
        f"(in {d['groups_with_twins']} of {d['n_groups']} prompt groups), where the responses' own probabilities "
        f"give {d['expected']:.3g} at {at}: samples are clones",
        {k: d[k] for k in ("n_samples", "n_groups", "twins", "expected", "groups_with_twins", "first_sample")}
        | {"rare_twins": d["rare_twins"], "rare_expected": d["rare_expected"], "rare_chance": RARE_CHANCE}
        | {"temperature": temperature},
    )
