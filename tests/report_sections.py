"""metrics.json sections of the attribution, forensics, worst-token and breakdown producers, in the
shape the report contract gives them, filled into a real report's metrics for the renderer's tests.

The values are arbitrary but consistent (counts add up, rates lie in [0, 1]); token texts carry
markup and ampersands, which the page must show as text."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from mismatch_probe.report.build import compute_comparisons
from mismatch_probe.report.keys.request import ReportRequest
from mismatch_probe.report.render.page import write_index
from mismatch_probe.report.render.plots import write_plots
from mismatch_probe.rundir.layout import Run

HOSTILE_TOKEN = "<script>alert('x')</script>&amp"
POSITION_EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128]
REF_PROB_EDGES = [0, 1e-3, 1e-2, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1]


def breakdown(edges: list, rng, thresholds: list[str]) -> dict:
    n = rng.integers(0, 400, len(edges) - 1)
    n[-1] = 0  # an empty bin has null means
    k3 = [float(v) if c else None for v, c in zip(10 ** rng.uniform(-5, -2, len(n)), n)]
    out = {
        "edges": edges,
        "n_tokens": n.tolist(),
        "k3_kl": k3,
        "abs_logprob_diff_mean": [None if v is None else 3 * v for v in k3],
    }
    for t in thresholds:
        out[f"extreme_fraction@{t}"] = [None if v is None else min(1.0, 10 * v) for v in k3]
    return out


def worst_tokens(count: int, rng, routed: bool) -> list[dict]:
    entries = []
    for rank in range(count):
        p_ref, p_cand = float(rng.uniform(0.01, 1)), float(rng.uniform(0.01, 1))
        token = HOSTILE_TOKEN if rank == 0 else ("\n" if rank == 1 else f" tok{rank}")
        entries.append(
            {
                "sample_id": int(rng.integers(0, 40)),
                "position": int(rng.integers(4, 90)),
                "response_index": rank,
                "token_id": 7 + rank,
                "token": token,
                "logprob_ref": float(np.log(p_ref)),
                "logprob_cand": float(np.log(p_cand)),
                "p_ref": p_ref,
                "p_cand": p_cand,
                "delta": float(np.log(p_cand / p_ref)),
                "top_token_id_ref": 3,
                "top_token_id_cand": None if rank % 3 else 4,
                "top_token_ref": "<b>&lt;",
                "top_token_cand": None if rank % 3 else "R&D",
                "routing_diff_layers": int(rng.integers(0, 3)) if routed else None,
                "context": {
                    "prompt_tail": "Q: 2 & 3 < 5?" if rank else None,
                    "response_before": "A: <i>yes</i> " * (rank + 1),
                },
            }
        )
    return entries


def forensics(num_layers: int, rng) -> dict:
    first = rng.integers(0, 50, num_layers)
    slots = rng.integers(100, 1000, 8)
    return {
        "first_diff_layer": first.tolist(),
        "n_tokens_routed": int(first.sum() * 5),
        "n_tokens_differing": int(first.sum()),
        "margin_flip": {
            "side": "reference",
            "edges": [0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0],
            "slots": slots.tolist(),
            "flips": (slots * np.logspace(-0.3, -4, 8)).astype(int).tolist(),
        },
    }


def with_sections(metrics: dict, num_layers: int, seed: int = 0, worst: int = 14) -> dict:
    """A copy of `metrics` with every section of the contract filled in."""
    rng = np.random.default_rng(seed)
    out = copy.deepcopy(metrics)
    for comp in out["comparisons"]:
        m = comp["metrics"]
        thresholds = [k.split("@", 1)[1] for k in m if k.startswith("extreme_fraction@") and not k.endswith("_ci95")]
        routed = m.get("n_routing_tokens") is not None and comp.get("routing_histograms") is not None
        comp["breakdowns"] = {
            "by_response_position": breakdown(POSITION_EDGES, rng, thresholds),
            "by_ref_prob": breakdown(REF_PROB_EDGES, rng, thresholds),
        }
        comp["worst_tokens"] = worst_tokens(worst, rng, routed)
        comp["routing_forensics"] = forensics(num_layers, rng) if routed else None
        for split, share in (("same", 0.3), ("diff", 3.0)):
            k3 = None if not routed or m["k3_kl"] is None else m["k3_kl"] * share
            m[f"k3_kl@routing_{split}"] = k3
            m[f"k3_kl@routing_{split}_ci95"] = None if k3 is None else [0.8 * k3, 1.2 * k3]
            m[f"n_tokens@routing_{split}"] = None if k3 is None else m["n_tokens"] // 2
    out["attribution"] = {
        "headlines": [
            "Noise floor: pass 1 vs pass 2 has k3 KL 1.2e-06 [9e-07, 1.5e-06] <& not markup>.",
            "Routing share: R3 removes 64% [51%, 75%] of k3 KL for hf bf16.",
        ],
        "missing": ["No fp32 score set: `probe rescore RUN --dtype fp32` would add each side's numerical error."],
        "noise_floor": [],
        "routing_share": [],
        "numerics": [],
        "engine_gap": [],
    }
    return out


def render_with_sections(root, **kwargs):
    """Re-render a finished report of the run at `root` with every section filled in; returns its metrics."""
    run = Run(Path(root))
    metrics = json.loads(run.metrics_path.read_text())
    pairs = [(c["reference"], c["candidate"]) for c in metrics["comparisons"]]
    comparisons = compute_comparisons(run, pairs, ReportRequest())
    full = with_sections(metrics, run.manifest().routing.num_layers or 0, **kwargs)
    plots = write_plots(run.report_dir, full["comparisons"], [c.probability.scatter for c in comparisons])
    write_index(run.report_dir, run, run.manifest(), full, plots)
    return full
