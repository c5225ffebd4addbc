"""`probe report` against the floor: a bare pyarrow scan of the same files and columns.

    .venv/bin/python benchmarks/bench_report.py [--tokens 2000000] [--work /tmp/probe-bench] [--repeats 2]
        [--scans row-groups,batches,side-threads]

Makes (or reuses) a synthetic run at the R3 paper's shape (48 MoE layers, top-8 of 128 experts),
then times, interleaved, `probe report` and bare scans that decode every column the report reads
and drop them: `row-groups` (read_row_group, pyarrow's threaded defaults), `batches` (iter_batches,
pyarrow defaults) and `side-threads` (16k-row batches, one thread per side, as the report reads).
The fastest scan is the floor. Each command runs in its own child process; its peak RSS is the
child's ru_maxrss as reported by wait4. Prints median wall times, the ratio report / floor and
peak RSS, and the same for CPU seconds (user + system, from wait4): on a machine whose cores other
processes share, wall times follow the load, CPU seconds much less. One untimed scan warms the page
cache first, so that no timed command alone reads from a cold cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_run import describe  # noqa: E402

COMPLETE = ".bench-complete"

# Three ways to decode the same columns with pyarrow and drop them; the fastest is the floor.
BARE_SCAN = """
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pyarrow.parquet as pq
from mismatch_probe.frames.align import side_columns
from mismatch_probe.rundir.layout import Run
run, method = Run(Path(sys.argv[1])), sys.argv[2]
shape = run.manifest().routing

def scan(side):
    rows, columns = 0, side_columns(run, side, shape)
    for part in sorted(run.side_dir(side).glob("part-*.parquet")):
        handle = pq.ParquetFile(part)
        if method == "row-groups":  # pyarrow defaults: threaded over columns
            rows += sum(handle.read_row_group(i, columns=columns).num_rows for i in range(handle.num_row_groups))
        elif method == "batches":  # pyarrow defaults: 64k-row batches, threaded
            rows += sum(b.num_rows for b in handle.iter_batches(columns=columns))
        else:  # what the report does: 16k-row batches, one thread per side
            rows += sum(b.num_rows for b in handle.iter_batches(1 << 14, columns=columns, use_threads=False))
    return rows

sides = ["rollout"] + [f"scores/{name}" for name in run.score_sets()]
if method == "side-threads":
    with ThreadPoolExecutor(len(sides)) as pool:
        print(sum(pool.map(scan, sides)))
else:
    print(sum(map(scan, sides)))
"""
SCAN_METHODS = ("row-groups", "batches", "side-threads")


def ensure_run(work: Path, tokens: int, layers: int, top_k: int, experts: int) -> Path:
    root = work / f"run-{tokens}-{layers}x{top_k}of{experts}"
    if (root / COMPLETE).is_file():
        print(f"reusing {root}")
        return root
    if root.exists():
        import shutil

        shutil.rmtree(root)
    print(f"writing {root} ...", flush=True)
    start = time.perf_counter()
    # In a child process: a child's ru_maxrss includes its parent's resident memory at fork time, so
    # writing the run here (GBs) would show as every later command's peak RSS.
    maker = Path(__file__).resolve().parent / "make_synthetic_run.py"
    options = ["--tokens", tokens, "--layers", layers, "--top-k", top_k, "--experts", experts]
    subprocess.run([sys.executable, str(maker), str(root), *map(str, options)], check=True, stdout=subprocess.DEVNULL)
    (root / COMPLETE).write_text("")
    print(f"written in {time.perf_counter() - start:.0f} s")
    return root


def add_run_options(parser: argparse.ArgumentParser, work: Path = Path("/tmp/probe-bench")) -> None:
    """The synthetic run's size and shape (the R3 paper's by default) and where it is kept between runs."""
    parser.add_argument("--tokens", type=int, default=2_000_000, help="response tokens of the synthetic run")
    parser.add_argument("--work", type=Path, default=work)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)


def run_of(args: argparse.Namespace) -> Path:
    """The run `add_run_options` describes, made or reused."""
    return ensure_run(args.work, args.tokens, args.layers, args.top_k, args.experts)


def measured(command: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in GB) of one child process; its output is checked, not shown."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command)} failed:\n{output.decode(errors='replace')}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each, interleaved")
    parser.add_argument("--scans", default=",".join(SCAN_METHODS), help=f"bare-scan methods to time, of {SCAN_METHODS}")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    root = run_of(args)
    print(describe(root))
    methods = [m for m in SCAN_METHODS if m in args.scans.split(",")]
    commands = {f"scan {m}": [sys.executable, "-c", BARE_SCAN, str(root), m] for m in methods}
    commands["report"] = [sys.executable, "-m", "mismatch_probe.cli", "report", str(root)]
    run_bytes = sum(p.stat().st_size for p in root.rglob("*.parquet"))
    # One untimed scan first, whatever the run's size: otherwise the first timed command alone reads from
    # a cold cache (a 20M-token scan: 55 s cold, 37 s after). A run larger than the page cache still reads
    # partly from disk, every command alike.
    measured(commands[f"scan {methods[0]}"])
    if run_bytes > 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        print("the run is larger than half the memory: reads come partly from disk")
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    rss: dict[str, float] = {name: 0.0 for name in commands}
    for i in range(args.repeats):
        for name, command in commands.items():
            seconds, cpu_seconds, peak = measured(command)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
            rss[name] = max(rss[name], peak)
            print(
                f"  run {i + 1}: {name:18s} {seconds:7.1f} s, CPU {cpu_seconds:7.1f} s, peak RSS {peak:5.2f} GB "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    median = {name: statistics.median(values) for name, values in times.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    floor = min((name for name in commands if name != "report"), key=median.get)
    floor_cpu = min((name for name in commands if name != "report"), key=median_cpu.get)
    print(f"cores: {os.cpu_count()}, load average at start: {load:.1f} (other processes share the cores)")
    for name in commands:
        print(
            f"{name:18s}: {median[name]:7.1f} s, CPU {median_cpu[name]:7.1f} s (medians of {args.repeats}), "
            f"peak RSS {rss[name]:.2f} GB"
        )
    print(f"ratio report / fastest bare scan ({floor}): {median['report'] / median[floor]:.2f}")
    cpu_ratio = median_cpu["report"] / median_cpu[floor_cpu]
    print(f"CPU ratio report / least CPU of a bare scan ({floor_cpu}): {cpu_ratio:.2f}")


if __name__ == "__main__":
    main()
