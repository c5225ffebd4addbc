"""`probe doctor` against `probe report` on the same synthetic run (the doctor must stay within 1.2x).

    .venv/bin/python benchmarks/bench_doctor.py [--tokens 2000000] [--work /tmp/probe-bench] [--repeats 2]
        [--layers 48] [--top-k 8] [--experts 128] [--before PATH]

Makes (or reuses) the synthetic run of bench_report.py, then times, interleaved, `probe doctor RUN` (the
checks in a pass of their own) and `probe report RUN` (which runs the checks inside its own pass). With
--before PATH (a checkout without the doctor), also times that checkout's `probe report`, so the cost
of the checks inside the report shows as the difference. Each command runs in its own child process;
wall times follow the load of a shared machine, CPU seconds (user + system) much less: both are printed,
with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import add_run_options, measured, run_of  # noqa: E402
from make_synthetic_run import describe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each, interleaved")
    parser.add_argument("--before", type=Path, help="a checkout whose `probe report` has no doctor")
    args = parser.parse_args()

    here = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = here  # this checkout's probe, in every child
    root = run_of(args)
    print(describe(root))
    commands = {
        "doctor": ([sys.executable, "-m", "mismatch_probe.cli", "doctor", str(root)], here),
        "report": ([sys.executable, "-m", "mismatch_probe.cli", "report", str(root)], here),
    }
    if args.before:
        commands["report (before)"] = (commands["report"][0], str(args.before.resolve()))
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    measured(commands["doctor"][0])  # warm the page cache
    for i in range(args.repeats):
        for name, (command, path) in commands.items():
            os.environ["PYTHONPATH"] = path
            seconds, cpu_seconds, peak = measured(command)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
            print(
                f"  run {i + 1}: {name:16s} {seconds:7.1f} s, CPU {cpu_seconds:7.1f} s, peak RSS {peak:5.2f} GB "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    wall = {name: statistics.median(values) for name, values in times.items()}
    cpus = {name: statistics.median(values) for name, values in cpu.items()}
    print(f"cores: {os.cpu_count()}, load average now: {os.getloadavg()[0]:.1f} (other processes share the cores)")
    for name in commands:
        print(f"{name:16s}: {wall[name]:7.1f} s, CPU {cpus[name]:7.1f} s (medians of {args.repeats})")
    print(f"doctor / report: wall {wall['doctor'] / wall['report']:.2f}, CPU {cpus['doctor'] / cpus['report']:.2f}")
    if args.before:
        before = "report (before)"
        print(
            f"report with the checks / without: wall {wall['report'] / wall[before]:.2f}, "
            f"CPU {cpus['report'] / cpus[before]:.2f}"
        )


if __name__ == "__main__":
    main()
