"""`probe report` over several processes: --workers 1, --workers N and --ray local against a bare pyarrow scan.

    .venv/bin/python benchmarks/bench_report_workers.py [--tokens 2000000] [--work /tmp/probe-bench-workers]
        [--workers 2] [--commands scan,workers1,workersN,ray] [--layers 48 --top-k 8 --experts 128]

Makes (or reuses) a synthetic run at the R3 paper's shape (bench_report.py's), then runs each command once,
in its own child process, in the order given: the bare scan (every column the report reads, 16k-row batches,
one thread per side, as bench_report.py's `side-threads`), and `probe report` with --workers 1, --workers N
and --ray local --workers N. While a command runs, its process tree is polled for each process's peak
resident memory (VmHWM): the driver's, and the largest of its workers' (pool processes, Ray tasks' workers;
Ray's own daemons are left out). Prints wall time, CPU seconds, speed-up over --workers 1, ratio to the scan, peak
RSS and the load average with each figure: on shared cores, wall times follow the load, CPU seconds less.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import BARE_SCAN, add_run_options, run_of  # noqa: E402
from make_synthetic_run import describe  # noqa: E402

WORKER_MARKS = ("spawn_main", "ray::")  # a pool process's and a Ray worker's command line


def _peak_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def measured(command: list[str]) -> tuple[float, float, float, float, int]:
    """(wall seconds, CPU seconds, driver peak RSS GB, largest worker peak RSS GB, workers seen) of one command.
    CPU seconds (wait4: the command and the children it reaped) count pool workers, not Ray's, whose
    workers are Ray's daemons' children."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peaks: dict[int, tuple[bool, int]] = {}  # pid -> (is a worker, peak kB)
    done = threading.Event()

    def poll() -> None:
        try:
            root = psutil.Process(child.pid)
        except psutil.Error:  # already gone
            return
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                tree = []
            for process in tree:
                try:
                    worker = any(mark in " ".join(process.cmdline()) for mark in WORKER_MARKS)
                except psutil.Error:
                    continue
                peak = _peak_kb(process.pid)
                peaks[process.pid] = (worker, max(peak, peaks.get(process.pid, (worker, 0))[1]))
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    poller.join()
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{output.decode(errors='replace')}")
    driver = peaks.get(child.pid, (False, 0))[1] * 1024 / 1e9
    workers = [peak for pid, (worker, peak) in peaks.items() if worker and pid != child.pid]
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, cpu, driver, max(workers, default=0) * 1024 / 1e9, len(workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser, work=Path("/tmp/probe-bench-workers"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--commands", default="scan,workers1,workersN,ray", help="which to run, in this order")
    args = parser.parse_args()

    root = run_of(args)
    print(describe(root), flush=True)
    report = [sys.executable, "-m", "mismatch_probe.cli", "report", str(root)]
    n = str(args.workers)
    every = {
        "scan": [sys.executable, "-c", BARE_SCAN, str(root), "side-threads"],
        "workers1": [*report, "--workers", "1"],
        "workersN": [*report, "--workers", n],
        "ray": [*report, "--ray", "local", "--workers", n],
    }
    labels = {"scan": "bare scan", "workers1": "--workers 1", "workersN": f"--workers {n}", "ray": "--ray local"}
    wall: dict[str, float] = {}
    print(f"cores: {os.cpu_count()}, available: {len(os.sched_getaffinity(0))}")
    for name in args.commands.split(","):
        before = os.getloadavg()[0]
        seconds, cpu, driver, worker, count = measured(every[name])
        wall[name] = seconds
        relative = []
        if name != "workers1" and "workers1" in wall:
            relative.append(f"{wall['workers1'] / seconds:.2f}x --workers 1")
        if name != "scan" and "scan" in wall:
            relative.append(f"{seconds / wall['scan']:.2f} of the scan")
        print(
            f"{labels[name]:13s} {seconds:7.1f} s, CPU {cpu:6.1f} s  {', '.join(relative):35s} peak RSS driver {driver:.2f} GB, "
            f"largest of {count} workers {worker:.2f} GB  (load {before:.1f} before, {os.getloadavg()[0]:.1f} after)",
            flush=True,
        )


if __name__ == "__main__":
    main()
