"""What a user might write without the probe, timed against `probe report` on the same small run.

    .venv/bin/python benchmarks/naive_baseline.py [--tokens 20000] [--work /tmp/probe-bench]

The naive version reads both sides with polars, joins them, computes k3 KL with polars
expressions, and compares routing with one Python set comparison per (token, layer). Prints both
wall times and what the naive per-token cost means at the paper's 20M response tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_run import paper_spec  # noqa: E402

from mismatch_probe.testing.synthetic import write_synthetic_run  # noqa: E402

PAPER_TOKENS = 20_000_000


def naive_metrics(root: Path, layers: int, top_k: int) -> dict:
    def side(folder: Path, suffix: str) -> pl.DataFrame:
        df = pl.read_parquet(
            folder / "part-*.parquet", columns=["sample_id", "position", "is_response", "logprob", "experts"]
        )
        return df.rename({c: c + suffix for c in ("is_response", "logprob", "experts")})

    score = sorted(p for p in (root / "scores").iterdir() if p.is_dir())[0]
    both = side(root / "rollout", "_ref").join(side(score, "_cand"), on=["sample_id", "position"])
    compared = both.filter(
        pl.col("is_response_ref") & pl.col("logprob_ref").is_not_null() & pl.col("logprob_cand").is_not_null()
    )
    log_r = pl.col("logprob_cand").cast(pl.Float64) - pl.col("logprob_ref").cast(pl.Float64)
    k3 = compared.select((log_r.exp() - 1 - log_r).mean()).item()
    routed = both.filter(pl.col("experts_ref").is_not_null() & pl.col("experts_cand").is_not_null())
    differing = pairs = 0
    for ref, cand in zip(routed["experts_ref"].to_list(), routed["experts_cand"].to_list()):  # one row per token
        for layer in range(layers):
            lo = layer * top_k
            pairs += 1
            differing += set(ref[lo : lo + top_k]) != set(cand[lo : lo + top_k])
    return {"k3_kl": k3, "router_diff_rate": differing / pairs, "rows": both.height, "responses": compared.height}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="response tokens of the small run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/probe-bench"))
    args = parser.parse_args()

    root = args.work / f"naive-{args.tokens}"
    if not (root / "manifest.json").is_file():
        spec = paper_spec(args.tokens, response_len=(128, 2048))
        write_synthetic_run(root, spec)
    start = time.perf_counter()
    naive = naive_metrics(root, 48, 8)
    naive_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mismatch_probe.cli", "report", str(root)], check=True, capture_output=True)
    probe_s = time.perf_counter() - start
    import json

    probe = json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]
    assert np.isclose(naive["k3_kl"], probe["k3_kl"]) and np.isclose(
        naive["router_diff_rate"], probe["router_diff_rate"]
    )
    rows = naive["rows"]
    print(f"{root}: {rows:,} tokens (prompt + response), 48 layers x top-8; both agree on k3_kl and router_diff_rate")
    per_token = naive_s / rows
    print(
        f"naive polars + Python sets: {naive_s:6.1f} s ({per_token * 1e6:.1f} us/token; linear, so "
        f"~{per_token * PAPER_TOKENS * rows / naive['responses'] / 3600:.1f} h and all rows in memory at 20M response tokens)"
    )
    print(
        f"probe report              : {probe_s:6.1f} s (start-up and plots included; its cost at scale: bench_report.py)"
    )


if __name__ == "__main__":
    main()
