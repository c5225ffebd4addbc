"""A stand-in `sglang` module whose `Engine` answers from the recorded SGLang 0.5.23 answers.

`Engine.generate` has the keyword names of SGLang's own `Engine.generate` that the probe uses (read
from python/sglang/srt/entrypoints/engine.py), so a misspelt argument fails here as it would there.
Each request of a batch is answered by the same route function as the replaying HTTP server in
tests/fake_servers.py, so both engines see identical answer dicts. Nothing of SGLang runs.
"""

from __future__ import annotations

import importlib.machinery
import types

from fake_servers import sglang_routes


class FakeEngine:
    instances: list["FakeEngine"] = []

    def __init__(self, routes: dict, **kwargs):
        self.kwargs = kwargs
        self.server_args = types.SimpleNamespace(**{**routes["/get_server_info"](None, None)[1], **kwargs})
        self.generate_route = routes["/generate"]
        self.calls: list[dict] = []
        self.shut = False
        FakeEngine.instances.append(self)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, return_routed_experts=False,
                 routed_experts_start_len=0, stream=False):
        call = dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                    return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len)
        self.calls.append(call)
        answers = []
        for ids, sampling in zip(input_ids, sampling_params):
            body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": return_logprob,
                    "top_logprobs_num": top_logprobs_num, "return_routed_experts": return_routed_experts}
            answers.append(self.generate_route(body, None)[1])
        return answers

    def shutdown(self):
        self.shut = True


def fake_sglang_module(**route_args) -> types.ModuleType:
    routes = sglang_routes(**route_args)
    module = types.ModuleType("sglang")
    module.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    module.__version__ = "0.5.23"
    module.Engine = lambda **kwargs: FakeEngine(routes, **kwargs)
    return module
