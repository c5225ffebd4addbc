"""The demo's second process: the dense model, the production rollouts and the sweep, run beside the MoE model's
section, which the first process runs.

Why: the demo models are tiny (hidden size 128), so no torch op is large enough to share between threads. On 2
cores, two intra-op threads spent 5 min 57 s of CPU on the demo against 3 min 39 s for one thread, for about the
same wall time: the second thread mostly waits at each op's barrier. So each process computes with one thread
(half the cores each, on larger machines), and the sections that do not read each other's runs go side by side.
The second process is `python -m` beside_main.py, as report/render/drawing.py starts its workers: not a fork (the
caller may hold threads, whose locks a fork copies held) and not multiprocessing's spawn (which re-imports the
caller's `__main__`). Its output is kept in a temporary file and printed when it ends, so that the two
processes' progress bars do not interleave.

The split is by measured step times (the demo's step table): the MoE model's run is the longer section, so its
megatron passes and its repeated bf16 passes run in the second process once the first has written its rollout,
and the first waits for them before its MoE report (handoff.py). On 2 idle cores that leaves the two processes
within about 10 s of each other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import EngineFailure
from mismatch_probe.pipeline.demo.handoff import Handoff
from mismatch_probe.progress import console

# What a one-process gloo group of the megatron engine leaves in os.environ (engines/megatron/shims.py): the second
# process must pick its own port, not join the first's group.
_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
ENTRY = "mismatch_probe.pipeline.demo.beside_main"  # what the second process runs: `python -m` it
WHAT = "the demo's second process (dense model, MoE megatron passes, production rollouts, sweep)"


def threads_per_process() -> int:
    """Intra-op threads for each of the two processes: half the cores, at least one."""
    return max(1, (os.cpu_count() or 2) // 2)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class BesideProcess:
    process: subprocess.Popen
    folder: Path  # its output, its step times and the hand-offs (handoff.py), removed when it ends

    @property
    def log(self) -> Path:  # its stdout and stderr
        return self.folder / "output.log"

    @property
    def clock(self) -> Path:  # where it writes its step times
        return self.folder / "clock.json"

    @property
    def handoff(self) -> Handoff:
        return Handoff(folder=self.folder)

    @classmethod
    def start(cls, out: Path, models: Path, prompts: Path, num_prompts: int, max_new_tokens: int) -> BesideProcess:
        folder = Path(tempfile.mkdtemp(prefix="probe-demo-"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        if env.get("WORLD_SIZE", "1") == "1":
            for key in _GROUP_ENV:
                env.pop(key, None)
        args = [str(a) for a in (out, models, prompts, num_prompts, max_new_tokens, folder)]
        with (folder / "output.log").open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", ENTRY, *args], stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        return cls(process=process, folder=folder)

    def wait_for(self, what: str) -> None:
        """Returns once the second process has said `what` (handoff.py); its failure, one line, if it ended
        without saying it."""

        def alive() -> bool:
            return self.process.poll() is None

        try:
            self.handoff.wait(what, alive, WHAT)
        except EngineFailure:
            self.wait()  # raises its own failure when it failed
            raise

    def wait(self) -> list[tuple[str, float]]:
        """Its output printed here, then its steps; EngineFailure naming its last line when it failed."""
        code = self.process.wait()
        text = self.log.read_text(encoding="utf-8", errors="replace")
        console.rule(f"[bold]{WHAT}: its output")
        console.out(text.rstrip("\n"), highlight=False)
        try:
            if code != 0:
                last = next((line for line in reversed(text.splitlines()) if line.strip()), f"exit code {code}")
                raise EngineFailure(f"{WHAT} failed (exit code {code}): {last.strip()}")
            return [(row["step"], row["seconds"]) for row in json.loads(self.clock.read_text())["steps"]]
        finally:
            self.cleanup()

    def stop(self) -> None:
        """Ended at once (the first process failed or was interrupted)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
