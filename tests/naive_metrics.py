"""A second, deliberately naive implementation of the SPEC section 5 metrics: Python loops and sets."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def read_side(directory: Path) -> list[dict]:
    rows = []
    for path in sorted(Path(directory).glob("part-*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


def naive_metrics(ref_rows, cand_rows, num_layers, top_k, thresholds=(1.5, 2, 5, 10), scope="all") -> dict:
    ratios, deltas, prob_diffs = [], [], []
    flips = compared_top = 0
    for a, b in zip(ref_rows, cand_rows):
        if not a["is_response"]:
            continue
        if a.get("top_token_id") is not None and b.get("top_token_id") is not None:
            compared_top += 1
            flips += a["top_token_id"] != b["top_token_id"]
        la, lb = a["logprob"], b["logprob"]
        if la is None or lb is None or not math.isfinite(la) or not math.isfinite(lb):
            continue
        deltas.append(lb - la)
        ratios.append(math.exp(lb) / math.exp(la))
        prob_diffs.append(abs(math.exp(lb) - math.exp(la)))
    n = len(ratios)
    out = {
        "n_tokens": n,
        "k3_kl": sum(r - 1 - math.log(r) for r in ratios) / n,
        "k1_kl": sum(-math.log(r) for r in ratios) / n,
        "k2_kl": sum(0.5 * math.log(r) ** 2 for r in ratios) / n,
        "abs_logprob_diff_mean": sum(abs(d) for d in deltas) / n,
        "abs_logprob_diff_max": max(abs(d) for d in deltas),
        "abs_prob_diff_mean": sum(prob_diffs) / n,
        "abs_prob_diff_max": max(prob_diffs),
        "argmax_flip_rate": flips / compared_top if compared_top else None,
    }
    for t in thresholds:
        out[f"extreme_fraction@{t}"] = sum(max(r, 1 / r) > t for r in ratios) / n
    out.update(naive_routing(ref_rows, cand_rows, num_layers, top_k, scope))
    return out


def naive_routing(ref_rows, cand_rows, num_layers, top_k, scope="all") -> dict:
    if num_layers == 0:
        return {}
    pair_diffs, token_diffs, per_seq = [], [], {}
    for a, b in zip(ref_rows, cand_rows):
        if a["experts"] is None or b["experts"] is None or (scope == "response" and not a["is_response"]):
            continue
        total = 0
        for layer in range(num_layers):
            s_ref = set(a["experts"][layer * top_k : (layer + 1) * top_k])
            s_cand = set(b["experts"][layer * top_k : (layer + 1) * top_k])
            diff = top_k - len(s_ref & s_cand)
            pair_diffs.append(diff)
            total += diff
        token_diffs.append(total)
        per_seq.setdefault(a["sample_id"], []).append(total)
    if not token_diffs:
        return {"router_diff_rate": None}
    return {
        "router_diff_rate": sum(d > 0 for d in pair_diffs) / len(pair_diffs),
        "router_diff_mean": sum(pair_diffs) / len(pair_diffs),
        "token_diff_rate": sum(d > 0 for d in token_diffs) / len(token_diffs),
        "token_diff_mean": sum(token_diffs) / len(token_diffs),
        "seq_router_diff_mean": sum(sum(v) / len(v) for v in per_seq.values()) / len(per_seq),
        "n_routing_tokens": len(token_diffs),
    }


# ---- correction what-ifs and bootstrap intervals, one sequence at a time ------------------------


def sequence_deltas(ref_rows, cand_rows) -> dict[int, list[float]]:
    """sample_id -> delta of each response token with finite log-probs on both sides (in order)."""
    out: dict[int, list[float]] = {}
    for a, b in zip(ref_rows, cand_rows):
        la, lb = a["logprob"], b["logprob"]
        if not a["is_response"] or la is None or lb is None or not math.isfinite(la) or not math.isfinite(lb):
            continue
        out.setdefault(a["sample_id"], []).append(float(lb) - float(la))
    return out


def naive_corrections(sequences: list[list[float]], caps=(2, 5), bounds=(1.001, 1.01)) -> dict:
    """The correction keys from per-sequence delta lists. verl's names average over every sequence, one with no
    token counting with a mean of 0; the geometric filter counts only sequences with a token."""
    tokens = [d for s in sequences for d in s]
    n, n_seq = len(tokens), len(sequences)
    means = [sum(s) / len(s) if s else 0.0 for s in sequences]
    ratios = [math.exp(d) for d in tokens]
    clamp = lambda x: min(20.0, max(-20.0, x))  # noqa: E731
    out = {
        "log_ppl_diff": sum(-m for m in means) / n_seq,
        "log_ppl_abs_diff": sum(abs(m) for m in means) / n_seq,
        "ppl_ratio": sum(math.exp(-m) for m in means) / n_seq,
        "chi2_token": sum(math.exp(2 * clamp(d)) - 1 for d in tokens) / n,
        "chi2_seq": sum(math.exp(2 * clamp(sum(s))) - 1 for s in sequences) / n_seq,
        "is_ess": sum(ratios) ** 2 / (n * sum(r * r for r in ratios)),
    }
    for c in caps:
        out[f"tis_clip_fraction@{c}"] = sum(r > float(c) for r in ratios) / n
    for t in bounds:
        kept = [m for m, s in zip(means, sequences) if s]
        out[f"seq_geo_reject_fraction@{t}"] = sum(math.exp(abs(m)) > float(t) for m in kept) / len(kept)
    return out


def naive_k3(sequences: list[list[float]]) -> float:
    tokens = [d for s in sequences for d in s]
    return sum(math.exp(d) - 1 - d for d in tokens) / len(tokens)


def naive_bootstrap_interval(sequences: list, statistic, resamples: int, seed: int) -> tuple[float, float]:
    """Classic bootstrap: draw len(sequences) sequences with replacement, 2.5 and 97.5 percentiles."""
    rng = random.Random(seed)
    values = sorted(statistic([rng.choice(sequences) for _ in sequences]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


# ---- routing forensics, one token and one (token, layer) slot at a time ---------------------------


def _differing_layers(a, b, num_layers, top_k) -> list[bool]:
    return [
        set(a["experts"][layer * top_k : (layer + 1) * top_k]) != set(b["experts"][layer * top_k : (layer + 1) * top_k])
        for layer in range(num_layers)
    ]


def _margin_bin(margin, edges) -> int | None:
    """The bin of a margin: [edges[i], edges[i+1]), the first bin also below 0, the last closed above."""
    if margin is None or not math.isfinite(margin):
        return None
    found = 0
    for i in range(len(edges) - 1):
        if margin >= float(np.float32(edges[i])):  # margins are float32: so are the edges they meet
            found = i
    return found


def naive_forensics(ref_rows, cand_rows, num_layers, top_k, scope="all", margin_side=None, edges=()) -> dict:
    """k3 over routing-same / routing-diff tokens, the first differing layer, flips per margin bin."""
    k3 = {"same": [], "diff": []}
    first_diff = [0] * num_layers
    routed = differing = 0
    slots, flips = [0] * (len(edges) - 1), [0] * (len(edges) - 1)
    before = None  # (sample, position, differing layers or None) of the row before: it judges the next token
    for a, b in zip(ref_rows, cand_rows):
        both = a["experts"] is not None and b["experts"] is not None
        routed_here = both and (scope != "response" or a["is_response"])
        # the k3 split judges token p by row p - 1 whatever the routing scope (a prompt row scores the first token)
        differs = _differing_layers(a, b, num_layers, top_k) if both else None
        scored_by = before[2] if before and before[:2] == (a["sample_id"], a["position"] - 1) else None
        before = (a["sample_id"], a["position"], differs)
        la, lb = a["logprob"], b["logprob"]
        usable = a["is_response"] and la is not None and lb is not None and math.isfinite(la) and math.isfinite(lb)
        if usable and scored_by is not None:  # token p is judged by routing row p - 1, the forward that scored it
            r = math.exp(float(lb) - float(la))
            k3["diff" if any(scored_by) else "same"].append(r - 1 - math.log(r))
        if not routed_here:
            continue
        routed += 1
        if any(differs):
            differing += 1
            first_diff[differs.index(True)] += 1
        margins = {"reference": a, "candidate": b}.get(margin_side, {}).get("router_margin")
        for layer in range(num_layers if margins is not None else 0):
            at = _margin_bin(margins[layer], edges)
            if at is not None:
                slots[at] += 1
                flips[at] += differs[layer]
    return {
        "k3_kl@routing_same": sum(k3["same"]) / len(k3["same"]) if k3["same"] else None,
        "k3_kl@routing_diff": sum(k3["diff"]) / len(k3["diff"]) if k3["diff"] else None,
        "n_tokens@routing_same": len(k3["same"]),
        "n_tokens@routing_diff": len(k3["diff"]),
        "first_diff_layer": first_diff,
        "n_tokens_routed": routed,
        "n_tokens_differing": differing,
        "slots": slots,
        "flips": flips,
    }


# ---- worst tokens and breakdowns, one token at a time ---------------------------------------------


def naive_compared_tokens(ref_rows, cand_rows, num_layers=0, top_k=0) -> list[dict]:
    """Every response token with finite log-probs on both sides, with its response index and routing diff."""
    out, seen = [], {}
    for a, b in zip(ref_rows, cand_rows):
        if not a["is_response"]:
            continue
        index = seen.get(a["sample_id"], 0)
        seen[a["sample_id"]] = index + 1
        la, lb = a["logprob"], b["logprob"]
        if la is None or lb is None or not math.isfinite(la) or not math.isfinite(lb):
            continue
        routing = None
        if num_layers and a["experts"] is not None and b["experts"] is not None:
            routing = sum(
                set(a["experts"][layer * top_k : (layer + 1) * top_k])
                != set(b["experts"][layer * top_k : (layer + 1) * top_k])
                for layer in range(num_layers)
            )
        out.append(
            {
                "sample_id": a["sample_id"],
                "position": a["position"],
                "response_index": index,
                "token_id": a["token_id"],
                "logprob_ref": float(la),
                "logprob_cand": float(lb),
                "p_ref": math.exp(la),
                "p_cand": math.exp(lb),
                "delta": float(lb) - float(la),
                "top_token_id_ref": a.get("top_token_id"),
                "top_token_id_cand": b.get("top_token_id"),
                "routing_diff_layers": routing,
            }
        )
    return out


def naive_worst(ref_rows, cand_rows, n, num_layers=0, top_k=0) -> list[dict]:
    tokens = naive_compared_tokens(ref_rows, cand_rows, num_layers, top_k)
    tokens.sort(key=lambda t: (-abs(t["delta"]), t["sample_id"], t["position"]))
    return tokens[:n]


def _naive_bins(tokens, bin_of, n_bins, thresholds) -> dict:
    members = [[t for t in tokens if bin_of(t) == b] for b in range(n_bins)]
    mean = lambda values, group: sum(values) / len(group) if group else None  # noqa: E731
    out = {
        "n_tokens": [len(g) for g in members],
        "k3_kl": [mean([math.exp(t["delta"]) - 1 - t["delta"] for t in g], g) for g in members],
        "abs_logprob_diff_mean": [mean([abs(t["delta"]) for t in g], g) for g in members],
    }
    for th in thresholds:
        out[f"extreme_fraction@{th}"] = [
            mean([max(math.exp(t["delta"]), math.exp(-t["delta"])) > float(th) for t in g], g) for g in members
        ]
    return out


def naive_breakdowns(
    ref_rows, cand_rows, thresholds=(1.5, 2, 5, 10), prob_edges=(0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1)
) -> dict:
    tokens = naive_compared_tokens(ref_rows, cand_rows)
    position_bin = lambda t: 0 if t["response_index"] == 0 else int(math.floor(math.log2(t["response_index"]))) + 1  # noqa: E731
    prob_bin = lambda t: min(sum(t["p_ref"] >= e for e in prob_edges[1:]), len(prob_edges) - 2)  # noqa: E731
    n_position = max(map(position_bin, tokens)) + 1
    return {
        "by_response_position": {
            "edges": [0] + [2**b for b in range(n_position)],
            **_naive_bins(tokens, position_bin, n_position, thresholds),
        },
        "by_ref_prob": {"edges": list(prob_edges), **_naive_bins(tokens, prob_bin, len(prob_edges) - 1, thresholds)},
    }
