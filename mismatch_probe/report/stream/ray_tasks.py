"""`probe report --ray ADDRESS`: the units of a report as Ray tasks (the optional extra `[ray]`).

`local` starts a Ray instance on this machine with --workers CPUs, `auto` joins the cluster this process
runs in, `ray://host:port` a remote one; a process already connected to Ray (build_report called from a Ray
driver) uses its connection and keeps it. Each task reads its own row groups from the run's path, which every
node must see at the same path (a shared file system): the driver sends the task a range of sample ids,
never data. A task whose worker process dies is run again by Ray (max_retries); a part that cannot be
read fails the report with the task's one-line error.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mismatch_probe
from mismatch_probe.errors import ProbeError, WorkerLost, first_line
from mismatch_probe.report.stream.plan import Unit
from mismatch_probe.report.stream.scan import ScanJob, UnitScan, scan_unit

INSTALL = "pip install 'mismatch-probe[ray]'"
LOCAL = "local"
MAX_RETRIES = 3  # reruns of a task whose worker died (not of one that raised)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ProbeError(f"--ray needs ray, which is not installed: {INSTALL}") from None
    return ray


@contextmanager
def ray_session(address: str, workers: int) -> Iterator[int]:
    """Ray started or joined for the report, and shut down after; yields the CPUs the tasks may use."""
    ray = import_ray()
    if ray.is_initialized():  # called from a Ray driver (an RL job's own): use its cluster and leave it running
        yield _cpus(ray)
        return
    quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        if address == LOCAL:
            # The local workers import this very package, from wherever this process found it.
            package_root = str(Path(mismatch_probe.__file__).resolve().parent.parent)
            path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
            ray.init(num_cpus=workers, runtime_env={"env_vars": {"PYTHONPATH": path}}, **quiet)
        else:
            ray.init(address=address, **quiet)
    except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError... for a bad address
        raise ProbeError(f"--ray {address}: cannot start or join Ray ({first_line(exc)})") from None
    try:
        yield _cpus(ray)
    finally:
        ray.shutdown()


def _cpus(ray) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def scan_on_ray(job: ScanJob, units: list[Unit], advance: Callable[[], None]) -> list[UnitScan]:
    """Each unit's comparisons from its own task, in unit order."""
    ray = import_ray()
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(scan_unit)
    unit_of = {task.remote(job, unit): unit for unit in units}
    results: list = [None] * len(units)
    pending = list(unit_of)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                results[unit_of[ref].index] = _result(ray, ref, unit_of[ref])
                advance()
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return results


def _result(ray, ref, unit: Unit) -> UnitScan:
    try:
        # A copy: arrays Ray hands back live read-only in its object store, and merging adds into them.
        return copy.deepcopy(ray.get(ref))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ProbeError):  # bad input: its own one line
            raise type(cause)(str(cause)) from None
        raise ProbeError(f"Ray task for {unit} failed: {first_line(cause or exc)}") from None
    except ray.exceptions.RayError as exc:  # the worker died more often than max_retries, the node left...
        raise WorkerLost(f"Ray task for {unit} failed: {first_line(exc)}") from None
