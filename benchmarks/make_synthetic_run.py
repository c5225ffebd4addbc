"""Write a synthetic run of any shape and size (rollout/ plus scores/NAME/) with the probe's own writer.

    .venv/bin/python benchmarks/make_synthetic_run.py OUT [--tokens 2000000] [--layers 48] [--top-k 8]
        [--experts 128] [--response-len 128,16384] [--response-dist lognormal] [--route-fraction 0.01]

Defaults are the R3 paper's shape (Qwen3-30B-A3B: 48 MoE layers, top-8 of 128 experts) with
long-tailed response lengths. `--tokens` counts response tokens, as the paper does; prompts come on top.
Prints the run's size and how long it took to write.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, response_lengths, write_synthetic_run

PART_TOKENS = 1 << 18  # tokens per part file: bounds the writer's memory (~100 MB of expert ids per side)


def int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    low, high = int(low), int(high or low)
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH with 0 < LOW <= HIGH")
    return low, high


def paper_spec(
    tokens: int,
    layers=48,
    top_k=8,
    experts=128,
    prompt_len=(64, 512),
    response_len=(128, 16384),
    response_dist="lognormal",
    route_fraction=0.01,
    logprob_sigma=0.02,
    score_sets=1,
    seed=0,
) -> SyntheticSpec:
    """A spec whose responses add up to about `tokens`, parts of about PART_TOKENS tokens."""
    probe = SyntheticSpec(response_len=response_len, response_dist=response_dist, n_samples=100_000, seed=seed + 1)
    mean_response = float(response_lengths(np.random.default_rng(seed + 1), probe).mean())
    mean_total = mean_response + sum(prompt_len) / 2
    sets = tuple(
        ScoreSetSpec(f"synthetic-{i}", logprob_sigma=logprob_sigma, route_fraction=route_fraction)
        for i in range(score_sets)
    )
    return SyntheticSpec(
        num_layers=layers,
        top_k=top_k,
        num_experts=experts,
        n_samples=max(1, round(tokens / mean_response)),
        prompt_len=prompt_len,
        response_len=response_len,
        response_dist=response_dist,
        seed=seed,
        samples_per_part=max(1, int(PART_TOKENS / mean_total)),
        score_sets=sets,
        vocab_size=151_936,
    )


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.parquet"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="response tokens (about)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int_range, default=(64, 512))
    parser.add_argument("--response-len", type=int_range, default=(128, 16384))
    parser.add_argument("--response-dist", choices=("uniform", "lognormal"), default="lognormal")
    parser.add_argument("--route-fraction", type=float, default=0.01, help="(token, layer) slots with a swapped expert")
    parser.add_argument("--logprob-sigma", type=float, default=0.02, help="std of the log-prob noise")
    parser.add_argument("--score-sets", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)

    if args.out.exists():
        if not args.force:
            sys.exit(f"{args.out}: exists (use --force to replace it)")
        shutil.rmtree(args.out)
    spec = paper_spec(
        args.tokens,
        args.layers,
        args.top_k,
        args.experts,
        args.prompt_len,
        args.response_len,
        args.response_dist,
        args.route_fraction,
        args.logprob_sigma,
        args.score_sets,
        args.seed,
    )
    if args.layers == 0:
        spec = replace(spec, top_k=0, num_experts=0)
    start = time.perf_counter()
    write_synthetic_run(args.out, spec)
    seconds = time.perf_counter() - start
    print(describe(args.out))
    print(f"written in {seconds:.1f} s")


def describe(root: Path) -> str:
    """One line: tokens (response / all), sequences, shape, bytes on disk."""
    import pyarrow.parquet as pq

    from mismatch_probe.rundir.layout import Run

    run = Run(root)
    shape = run.manifest().routing
    rows = responses = sequences = 0
    for part in sorted((root / "rollout").glob("part-*.parquet")):
        meta = pq.ParquetFile(part).metadata
        rows += meta.num_rows
        table = pq.read_table(part, columns=["sample_id", "is_response"])
        responses += int(table.column("is_response").to_numpy(zero_copy_only=False).sum())
        sequences += len(np.unique(table.column("sample_id").to_numpy()))
    return (
        f"{root}: {responses:,} response tokens ({rows:,} with prompts) in {sequences:,} sequences, "
        f"{shape.num_layers} layers x top-{shape.top_k} of {shape.num_experts} experts, "
        f"{folder_bytes(root) / 1e9:.2f} GB of Parquet over {1 + len(run.score_sets())} sides"
    )


if __name__ == "__main__":
    main()
