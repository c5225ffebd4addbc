"""An SGLang 0.5.23 server stand-in that scores prompts by prefill, for `probe rescore --engine sglang`.

Its /get_server_info is SGLang's own resolved `ServerArgs`; its ordinary /generate answers are the replayed
real ones (fake_servers.sglang_routes). A request with `logprob_start_len=0` gets the prompt's log-probs in the
shape of the real answer in tests/fixtures/sglang-0.5.23/resp_temp.json (`input_token_logprobs` as
`[logprob, id, text]` with None first, `input_top_logprobs` likewise, routing for every prompt position,
`cached_tokens`, `weight_version`), computed by a float32 transformers forward of the fixture model, at T = 1
whatever the request's temperature (SGLang's rule without temp_scaled_logprobs), plus an engine error per token
(`engine_error`): what an inference engine's kernels add against a training engine's.
"""

from __future__ import annotations

import base64
import json
import zlib

import msgspec
import numpy as np
import torch
from fake_servers import FIXTURE_MODEL, load_fixture, sglang_routes
from sglang.srt.server_args import ServerArgs
from transformers import AutoModelForCausalLM

SIGMA = 0.01  # the engine's per-token error against the training engine, in nats


def engine_error(token_ids: list[int], salt: str) -> np.ndarray:
    """One N(0, SIGMA) draw per position p >= 1, seeded by the prefix ids[: p + 1] and `salt`: the same tokens
    always get the same error on one path ("prefill", "decode"), and the two paths' errors are independent."""
    out = np.zeros(len(token_ids))
    for p in range(1, len(token_ids)):
        seed = zlib.crc32(salt.encode() + np.asarray(token_ids[: p + 1], dtype="<i8").tobytes())
        out[p] = SIGMA * np.random.default_rng(seed).standard_normal()
    return out


class FixtureModel:
    def __init__(self):
        self.model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[n, V] float64 logits; row p predicts the token at p + 1."""
        return self.model(torch.tensor([token_ids])).logits[0].double()

    def logprobs(self, token_ids: list[int]) -> np.ndarray:
        """[n, V] log_softmax(logits) at T = 1; row p scores the token at p (row 0 is unused)."""
        lp = torch.log_softmax(self.logits(token_ids), -1).numpy()
        return np.concatenate([np.zeros((1, lp.shape[1])), lp[:-1]])


def server_info() -> dict:
    args = ServerArgs(model_path=str(FIXTURE_MODEL), dtype="float32", enable_return_routed_experts=True,
                      disable_radix_cache=True, enable_deterministic_inference=True)  # fmt: skip
    return msgspec.to_builtins(args.resolved_dict()) | {"version": "0.5.23"}


def prefill_routes(model: FixtureModel, cached_tokens: int = 0, sigma: float = SIGMA) -> dict:
    """`sigma` 0: the prompt log-probs are the fixture model's float32 ones, with no engine error."""
    routes = sglang_routes(server_args=server_info(), cached_tokens=cached_tokens)
    replay = routes["/generate"]
    recorded = load_fixture("resp_greedy")["meta_info"]["routed_experts"]
    rows = np.frombuffer(base64.b64decode(recorded), dtype="<i4").reshape(-1, 2, 2)

    def generate(body, server):
        if body.get("logprob_start_len") != 0:
            return replay(body, server)
        ids = [int(i) for i in body["input_ids"]]
        lp = model.logprobs(ids)
        own = np.minimum(lp[np.arange(len(ids)), ids] + engine_error(ids, "prefill") * (sigma / SIGMA), 0.0)
        top = int(body.get("top_logprobs_num") or 0)
        answer = json.loads(json.dumps(load_fixture("resp_temp")))
        meta = answer["meta_info"]
        meta["input_token_logprobs"] = [[None, ids[0], None]] + [
            [float(own[p]), ids[p], None] for p in range(1, len(ids))
        ]
        best = np.argsort(-lp, axis=1)[:, :top]
        meta["input_top_logprobs"] = [None] + [
            [[float(lp[p, t]), int(t), None] for t in best[p]] for p in range(1, len(ids))
        ]
        meta["prompt_tokens"], meta["cached_tokens"], meta["weight_version"] = len(ids), cached_tokens, "default"
        if body.get("return_routed_experts"):
            meta["routed_experts"] = base64.b64encode(
                np.resize(rows, (len(ids), 2, 2)).astype("<i4").tobytes()
            ).decode()
        return 200, answer

    return routes | {"/generate": generate}
