"""The engine-prefill pass of `probe diagnose`: the rollout's own inference engine scores the rollout by prefill
(`probe rescore RUN --engine sglang|vllm|sglang-offline|vllm-offline`), which splits the mismatch into the
engine's decode path against its own prefill and the engines' kernels against each other (the report's
decode_share). It runs where the rollout's engine can be reached: the server URL the rollout manifest records answers, or an in-process engine (sglang-offline,
vllm-offline) imports. Otherwise it is skipped with why, and its command says what to run once it can be."""

from __future__ import annotations

import shlex

import requests

from mismatch_probe.engines import PREFILL_ENGINES
from mismatch_probe.engines.extras import ENGINE_EXTRAS, engine_installed
from mismatch_probe.pipeline.diagnose.passes import ENGINE_PREFILL_PASS, Pass

READY_PATHS = {"sglang": "/get_model_info", "vllm": "/v1/models"}  # what each server answers once it serves
REACH_TIMEOUT_S = 3.0
OFFLINE_PREFILL = ("sglang-offline", "vllm-offline")  # in-process engines: reachable when they import


def server_answers(url: str, engine: str) -> str | None:
    """None when the server at `url` answers its model query; else what went wrong, in a few words."""
    try:
        reply = requests.get(url.rstrip("/") + READY_PATHS[engine], timeout=REACH_TIMEOUT_S)
    except requests.RequestException as exc:
        return f"no answer from {url} ({type(exc).__name__})"
    return None if reply.ok else f"{url} answered HTTP {reply.status_code}"


def prefill_pass(run, engine: str | None, server_url: str | None) -> Pass:
    """The pass, skipped with why where the rollout's engine cannot score by prefill now."""
    root = shlex.quote(str(run))
    prefill = engine in PREFILL_ENGINES
    command = f"probe rescore {root} --engine {engine if prefill else 'sglang|vllm'}"
    p = Pass(name=ENGINE_PREFILL_PASS, command=command, score_sets=[f"{engine}-prefill"] if prefill else [])
    if not prefill:
        p.skip(f"the rollout's engine {engine} is not an inference engine (sglang, vllm) with a prefill to compare")
    elif engine in OFFLINE_PREFILL:
        if not engine_installed(engine):
            p.skip(f"{engine} does not import here: {ENGINE_EXTRAS[engine].install_command()}, then run the command")
    elif not server_url:
        p.skip("the rollout manifest records no server URL: run the command with --engine-arg server_url=URL")
    else:
        down = server_answers(server_url, engine)
        if down is not None:
            p.skip(f"the rollout's {engine} server cannot be reached: {down}; start it and run the command")
    return p
