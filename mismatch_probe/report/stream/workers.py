"""The report's pass over a run by several processes, or by Ray tasks: plan units, scan each, merge in unit order.

Each unit's comparisons come back unfinished (pickled accumulator states) and are merged in the order of
their units whatever order they finish in, so a report is the same however many workers made it: counts
exactly, float sums up to rounding, the same bootstrap resamples (weights hash the sample id) and worst
tokens (a total order). One worker, or a run of one unit, scans in this process: no pool is started.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from mismatch_probe.errors import ProbeError, WorkerLost
from mismatch_probe.progress import progress_bar
from mismatch_probe.report.stream.plan import Unit, plan_units
from mismatch_probe.report.stream.scan import ScanJob, UnitScan, scan_sides, scan_unit
from mismatch_probe.rundir.layout import Run


def available_cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """Half the cores available: one report process already keeps about two busy (a reader thread per side
    beside the arithmetic), so on 2 cores a second process only contends; measured in
    benchmarks/bench_report_workers.py (2M tokens, 2 cores: 1 worker 5.3 s, 2 workers 6.1 s)."""
    return max(1, available_cores() // 2)


def parse_workers(value) -> int:
    if value is None:
        return default_workers()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProbeError(f"--workers: {value!r}, expected an integer >= 1")
    return value


def scan_run(job: ScanJob, workers: int, ray_address: str | None = None) -> UnitScan:
    """The accumulators of `job` over the whole run, merged, not finished."""
    run = Run(job.run_root)
    sides = scan_sides(job.new_comparisons(run))
    shape = run.manifest().routing
    if ray_address is not None:
        from mismatch_probe.report.stream.ray_tasks import ray_session, scan_on_ray

        with ray_session(ray_address, workers) as cpus:
            units = plan_units(run, sides, shape, cpus)
            return _merged(_with_progress(units, lambda advance: scan_on_ray(job, units, advance)))
    units = plan_units(run, sides, shape, workers)
    if workers == 1 or len(units) == 1:
        return _merged([scan_unit(job, unit) for unit in units])
    return _merged(_with_progress(units, lambda advance: _scan_in_pool(job, units, workers, advance)))


def _with_progress(units: list[Unit], scan: Callable) -> list[UnitScan]:
    with progress_bar() as bar:
        task = bar.add_task("report", total=len(units), unit="units")
        return scan(lambda: bar.advance(task))


def _scan_in_pool(job: ScanJob, units: list[Unit], workers: int, advance: Callable) -> list[UnitScan]:
    # spawn: a forked child would inherit the parent's threads (the prefetchers, torch's pools) mid-flight
    context = multiprocessing.get_context("spawn")
    results: list = [None] * len(units)
    with ProcessPoolExecutor(max_workers=min(workers, len(units)), mp_context=context) as pool:
        futures = {pool.submit(scan_unit, job, unit): unit for unit in units}
        try:
            for future in as_completed(futures):
                results[futures[future].index] = future.result()
                advance()
        except BrokenProcessPool as exc:
            raise WorkerLost(
                f"{job.run_root}: a report worker process died ({exc}); run again with --workers 1"
            ) from None
        finally:
            for future in futures:
                future.cancel()
    return results


def _merged(per_unit: list[UnitScan]) -> UnitScan:
    """The units' comparisons merged in unit order (the order does not change counts or ranks; fixing it
    makes float sums reproducible too)."""
    merged = per_unit[0]
    for other in per_unit[1:]:
        merged.merge(other)
    return merged
