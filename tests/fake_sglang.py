"""A stand-in for `sglang.Engine` of SGLang 0.5.23, set on the real `sglang` module (`install`).

SGLang's Engine cannot start on these machines (it needs SGLang's CUDA kernels, and resolving its
settings imports its model configs, which need torchvision). What stays SGLang's own here:
- the settings: the real `ServerArgs`, built from the Engine's keyword arguments as Engine.__init__
  builds it (sglang/srt/entrypoints/engine.py:297), and checked by SGLang's own deterministic-mode
  pass (srt/arg_groups/overrides.py:1092), the part of its resolution that needs no model loaded;
- the answers: SGLang's recorded answers, cut to each request by the same route function as the
  replaying HTTP server in tests/fake_servers.py, so both engines see identical answer dicts;
- a dying child: a child process sends SIGQUIT to this one and exits, as SGLang's scheduler does
  (srt/managers/scheduler.py:6370-6373); the handlers sit where SGLang puts them (engine.py:1970-1986
  while starting, tokenizer_manager.py:2453-2459 from the first request on), and SGLang's default
  ones kill the process tree with SGLang's own `kill_process_tree`, exit 137.
`generate` has the keyword names of SGLang's `Engine.generate` that the probe uses, so a misspelt
argument fails here as it would there. Environment CHILD_DIES: "start", or N for the Nth generate
call: a child process dies then.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import sglang
from fake_servers import sglang_routes
from sglang.srt.arg_groups.overrides import _deterministic_attention_backend
from sglang.srt.server_args import ServerArgs, resolving_view
from sglang.srt.utils.common import kill_process_tree

CHILD_DIES = "STANDIN_SGLANG_CHILD_DIES"
FAILING_SCHEDULER = (
    "import os, signal, sys; print('Scheduler hit an exception: RuntimeError: stand-in failure', file=sys.stderr, "
    "flush=True); os.kill(os.getppid(), signal.SIGQUIT); sys.exit(1)"
)


def kill_this_process_tree(signum=None, frame=None):
    """SGLang's own SIGQUIT handlers (engine.py:1976, tokenizer_manager.py:4072): SIGKILL everything."""
    kill_process_tree(os.getpid())


class SignalHandler:
    """SGLang's signal-handler class of the tokenizer manager, SIGQUIT part (tokenizer_manager.py:4063)."""

    def __init__(self, tokenizer_manager):
        self.tokenizer_manager = tokenizer_manager

    def running_phase_sigquit_handler(self, signum=None, frame=None):
        kill_this_process_tree()


class TokenizerManager:
    def __init__(self):
        self.signal_handler_class = SignalHandler  # as tokenizer_manager.py:893 sets it
        self.event_loop = None

    def auto_create_handle_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """At the first request, SGLang's SIGQUIT handler moves onto the event loop (tokenizer_manager.py:2440-2459)."""
        if self.event_loop is None:
            self.event_loop = loop
            loop.add_signal_handler(signal.SIGQUIT, self.signal_handler_class(self).running_phase_sigquit_handler)


class StandInEngine:
    instances: list[StandInEngine] = []

    def __init__(self, routes: dict, **kwargs):
        self.kwargs = kwargs
        self.server_args = ServerArgs(**kwargs)
        _deterministic_attention_backend(resolving_view(self.server_args))  # SGLang's ValueError, if any
        signal.signal(signal.SIGQUIT, self.server_args.custom_sigquit_handler or kill_this_process_tree)
        self.dies = os.environ.get(CHILD_DIES)
        self.children: list[subprocess.Popen] = []
        if self.dies == "start":
            self._wait_for_failing_scheduler()
        self.tokenizer_manager = TokenizerManager()
        self.loop = asyncio.new_event_loop()
        self.generate_route = routes["/generate"]
        self.calls: list[dict] = []
        self.shut = False
        StandInEngine.instances.append(self)

    def _failing_child(self) -> subprocess.Popen:
        self.children.append(subprocess.Popen([sys.executable, "-c", FAILING_SCHEDULER]))
        return self.children[-1]

    def _wait_for_failing_scheduler(self) -> None:
        """SGLang's wait for its schedulers (engine.py:2013), which here never become ready."""
        child = self._failing_child()
        while child.poll() is None:
            time.sleep(0.05)
        raise RuntimeError(f"Rank 0 scheduler died during initialization (exit code: {child.returncode}).")

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_routed_experts=False,
        routed_experts_start_len=0,
        stream=False,
    ):
        call = dict(
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
        )
        self.calls.append(call)
        self.tokenizer_manager.auto_create_handle_loop(self.loop)
        if self.dies == str(len(self.calls)):
            self._failing_child()
            never = self.loop.create_future()  # the answer a dead scheduler never sends
            return self.loop.run_until_complete(asyncio.wait_for(never, timeout=60))
        answers = []
        for ids, sampling in zip(input_ids, sampling_params):
            body = {
                "input_ids": ids,
                "sampling_params": sampling,
                "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num,
                "return_routed_experts": return_routed_experts,
                "routed_experts_start_len": routed_experts_start_len,
            }
            answers.append(self.generate_route(body, None)[1])
        return answers

    def shutdown(self):
        for child in self.children:
            child.wait()
        self.loop.close()  # also gives SIGQUIT back to its default
        self.shut = True


def install(set_attr=setattr, routes: dict | None = None, **route_args) -> None:
    """Put the stand-in on the real `sglang` module (`set_attr`: e.g. a pytest monkeypatch's setattr), answering
    from `routes` (the replaying server's by default)."""
    routes = routes or sglang_routes(**route_args)
    set_attr(sglang, "Engine", lambda **kwargs: StandInEngine(routes, **kwargs))
