"""A second, deliberately naive implementation of the SPEC section 5 metrics: Python loops and sets."""

from __future__ import annotations

import math
from pathlib import Path

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
