"""An SGLang Engine whose child process dies, told in one line instead of the probe being killed.

SGLang runs its scheduler and detokenizer in child processes. One that fails sends SIGQUIT to the
Engine's process (SGLang 0.5.23: srt/managers/scheduler.py:6373, detokenizer_manager.py:569; its
subprocess watchdog does the same for a child that crashed silently, srt/utils/watchdog.py:221), and
SGLang's own SIGQUIT handlers then SIGKILL that whole process tree, the probe included: exit 137,
no message. The probe replaces both handlers with ones that end the run with an EngineFailure:
- while the Engine starts: the `custom_sigquit_handler` setting (srt/entrypoints/engine.py:1986), a
  plain signal handler, so it raises in the main thread, out of `sglang.Engine(...)`;
- once requests run: the tokenizer manager's `signal_handler_class`, registered on the Engine's
  event loop at its first request (srt/managers/tokenizer_manager.py:2454-2459). Its callback runs
  inside that loop, where a raise would only be logged, so it stops the loop: the waiting
  `Engine.generate` returns with an error and `raise_if_died` names the cause.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from mismatch_probe.errors import EngineFailure


def died(when: str = "") -> str:
    return f"SGLang Engine died{when}: one of its processes failed (its error is printed above)"


class EngineDeath:
    """Whether an SGLang child process reported its death to this process."""

    def __init__(self) -> None:
        self.seen = False

    def on_start_sigquit(self, signum, frame) -> None:
        """`custom_sigquit_handler`: a child died while the Engine started."""
        if self.seen:  # a second child's SIGQUIT: the first one's error is already on its way
            return
        self.seen = True
        hint = "--help-engine sglang-offline lists settings known to work on CPU"
        raise EngineFailure(f"{died(' while starting')}; {hint}")

    def watch(self, engine) -> None:
        """Take over the SIGQUIT handler SGLang's tokenizer manager registers at the first request."""
        manager = getattr(engine, "tokenizer_manager", None)
        base = getattr(manager, "signal_handler_class", None)
        if base is not None:
            manager.signal_handler_class = reporting_handler_class(base, self)

    def raise_if_died(self, engine) -> None:
        """After a died child: stop the Engine's other processes and end the run with one line."""
        if self.seen:
            with suppress(Exception):  # they may be gone already; the error to show is the death
                engine.shutdown()
            raise EngineFailure(f"{died()}; finished parts are kept: re-run with --resume to continue")


def reporting_handler_class(base: type, death: EngineDeath) -> type:
    """SGLang's signal-handler class, whose SIGQUIT callback records the death instead of killing."""

    class ReportingSignalHandler(base):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            death.seen = True
            asyncio.get_running_loop().stop()  # Engine.generate's run_until_complete returns

    return ReportingSignalHandler
