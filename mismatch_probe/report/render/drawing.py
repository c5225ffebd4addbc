"""Draw the report's figures on several cores, in fresh Python processes.

matplotlib is single-threaded, and once the run has been read the report has nothing else to do, so the
figures are drawn in parallel. Not by forking this process: by then it has threads (the prefetchers,
pyarrow's, Ray's driver), and a fork copies their locks held (a `--ray local` report hung that way). Not
by multiprocessing's spawn or forkserver either: their workers import the caller's `__main__` again, which
re-runs any script that calls `build_report` without an `if __name__ == "__main__":` guard. A worker here
is `python -m mismatch_probe.report.render.drawing`: it reads pickled jobs on stdin and writes the SVGs on
stdout. A job is `(function, *args)` with a module-level function. If a worker fails, its jobs are drawn
in this process, so a real error in a figure surfaces here, with its traceback.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

MAX_WORKERS = 4


def draw(job: tuple) -> str:
    return job[0](*job[1:])


def draw_all(jobs: list[tuple]) -> list[str]:
    workers = min(len(jobs), os.cpu_count() or 1, MAX_WORKERS)
    if workers < 2:
        return [draw(job) for job in jobs]
    shares = [list(range(i, len(jobs), workers)) for i in range(workers)]  # round robin: big and small mixed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    started = []
    for share in shares:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            process.stdin.write(pickle.dumps([jobs[i] for i in share]))
            process.stdin.close()
        except BrokenPipeError:  # the worker is gone already: its jobs are drawn here below
            pass
        started.append(process)
    svgs: list[str | None] = [None] * len(jobs)
    for share, process in zip(shares, started):
        out = process.stdout.read()
        process.stdout.close()
        drawn = pickle.loads(out) if process.wait() == 0 and out else None
        for index, i in enumerate(share):
            svgs[i] = drawn[index] if drawn is not None else draw(jobs[i])
    return svgs


def _serve() -> None:
    jobs = pickle.load(sys.stdin.buffer)
    sys.stdout.buffer.write(pickle.dumps([draw(job) for job in jobs]))


if __name__ == "__main__":
    _serve()
