"""The demo's second process (beside.py): `python -m mismatch_probe.pipeline.demo.beside_main OUT MODELS PROMPTS
NUM_PROMPTS MAX_NEW_TOKENS FOLDER` runs the dense model's run, the MoE model's passes handed to it, the production
rollouts and the sweep on one torch thread per process, and writes its step times to FOLDER/clock.json. FOLDER
holds the hand-offs with the first process (handoff.py). A ProbeError is one line and its exit code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mismatch_probe.errors import ProbeError, first_line
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.pipeline.demo.beside import threads_per_process, torch_threads
from mismatch_probe.pipeline.demo.clock import StepClock
from mismatch_probe.pipeline.demo.handoff import Handoff
from mismatch_probe.pipeline.demo.run import beside_sections
from mismatch_probe.progress import console


def main(argv: list[str]) -> int:
    out, models, prompts, folder = Path(argv[0]), Path(argv[1]), Path(argv[2]), Path(argv[5])
    num_prompts, max_new_tokens = int(argv[3]), int(argv[4])
    parent = os.getppid()  # the first process: if it ends, this one is orphaned and its ppid changes

    def first_alive() -> bool:
        return os.getppid() == parent

    clock = StepClock()
    try:
        with torch_threads(threads_per_process()):
            beside_sections(out, models, prompts, num_prompts, max_new_tokens, clock, Handoff(folder), first_alive)
    except ProbeError as exc:
        console.print(f"error: {first_line(exc)}", markup=False, highlight=False)
        return exc.exit_code
    write_json_atomic(folder / "clock.json", clock.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
