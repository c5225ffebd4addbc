"""What the per-step split (issue 34) costs `probe report`: the same run reported with and without steps.

    .venv/bin/python benchmarks/bench_steps.py [--tokens 2000000] [--steps 200] [--layers 0] [--repeats 3]
        [--work /tmp/probe-bench-steps]

Makes (or reuses) a synthetic run of about `--tokens` response tokens (dense by default: the report's
fastest case, so the split's share of it is largest), then times the report's streaming pass and finish
(`compute_comparisons`, one process) alternately on the run as written (no steps) and with its samples
cut into `--steps` equal sample-id ranges in the manifest. Prints the median wall and CPU seconds of
each and the overhead of the split; the issue's target is at most 10 %.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_run import paper_spec  # noqa: E402

from mismatch_probe.report.build import compute_comparisons  # noqa: E402
from mismatch_probe.report.keys.request import ReportRequest  # noqa: E402
from mismatch_probe.rundir.layout import Run  # noqa: E402
from mismatch_probe.testing.synthetic import write_synthetic_run  # noqa: E402

COMPLETE = ".bench-complete"


def make_run(root: Path, tokens: int, layers: int) -> Run:
    marker = root / COMPLETE
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        moe = dict(layers=layers, top_k=min(8, layers) or 0, experts=128 if layers else 0)
        spec = paper_spec(tokens, prompt_len=(16, 256), response_len=(64, 4096), **moe)
        started = time.perf_counter()
        write_synthetic_run(root, spec)
        marker.touch()
        print(f"wrote {root} ({spec.n_samples} samples) in {time.perf_counter() - started:.1f} s")
    return Run(root)


def set_steps(run: Run, steps: int | None) -> None:
    """Cut the samples into `steps` equal sample-id ranges, or remove the steps."""
    manifest = json.loads(run.manifest_path.read_text())
    manifest.pop("steps", None)
    if steps:
        n = _samples(run)
        edges = [round(i * n / steps) for i in range(steps + 1)]
        manifest["steps"] = [[i, edges[i], edges[i + 1] - 1] for i in range(steps) if edges[i + 1] > edges[i]]
    run.manifest_path.write_text(json.dumps(manifest))


def _samples(run: Run) -> int:
    import pyarrow.parquet as pq

    last = 0
    for part in sorted(run.side_dir("rollout").glob("part-*.parquet")):
        ids = pq.read_table(part, columns=["sample_id"]).column("sample_id").to_numpy()
        last = max(last, int(ids.max()) + 1)
    return last


def timed(run: Run) -> tuple[float, float, int]:
    request = ReportRequest()
    wall, cpu = time.perf_counter(), time.process_time()
    comparisons = compute_comparisons(run, request.pair_list(run), request, workers=1)
    n = comparisons[0].probability.n_tokens
    return time.perf_counter() - wall, time.process_time() - cpu, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=0, help="MoE layers (0: dense)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/probe-bench-steps"))
    args = parser.parse_args()
    run = make_run(args.work / f"run-{args.tokens}-{args.layers}", args.tokens, args.layers)
    times = {"no steps": [], "steps": []}
    try:
        set_steps(run, None)
        timed(run)  # warm the page cache and the imports
        for _ in range(args.repeats):
            for label, steps in (("no steps", None), ("steps", args.steps)):
                set_steps(run, steps)
                wall, cpu, n = timed(run)
                times[label].append((wall, cpu))
    finally:
        set_steps(run, None)
    print(f"{n} compared tokens, {args.steps} steps, {'dense' if not args.layers else f'{args.layers} MoE layers'}")
    medians = {}
    for label, runs in times.items():
        medians[label] = [statistics.median(t[i] for t in runs) for i in (0, 1)]
        print(f"{label:>9}: wall {medians[label][0]:.2f} s, cpu {medians[label][1]:.2f} s (median of {len(runs)})")
    for i, what in enumerate(("wall", "cpu")):
        extra = medians["steps"][i] / medians["no steps"][i] - 1
        print(f"per-step split costs {100 * extra:+.1f} % {what}")


if __name__ == "__main__":
    main()
