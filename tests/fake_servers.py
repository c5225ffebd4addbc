"""Local HTTP servers that replay recorded inference-server answers, for testing the server engines.

`ReplayServer` listens on 127.0.0.1 (port 0: the OS picks a free one) in a background thread.
Each route maps a path to a function `(body, server) -> (status, json)`; the server counts calls
and the largest number of requests in flight at once, and can be told to fail the first N calls.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "sglang-0.5.23"  # see its README: real SGLang answers
FIXTURE_MODEL = FIXTURES / "model"
FIXTURE_PROMPT = list(range(10, 30))


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class ReplayServer:
    def __init__(self, routes: dict, delay_s: float = 0.0, fail_first: int = 0, fail_status: int = 503):
        self.routes = routes
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.calls: list[tuple[str, dict | None]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        # a short poll: shutdown() waits up to one poll interval (0.5 s by default, paid by every test)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> ReplayServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def calls_to(self, path: str) -> list[dict | None]:
        return [body for p, body in self.calls if p == path]

    def _answer(self, path: str, body: dict | None) -> tuple[int, object]:
        with self.lock:
            self.calls.append((path, body))
            failing = self.fail_first > 0 and path in ("/generate", "/v1/completions")
            if failing:
                self.fail_first -= 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            if failing:
                return self.fail_status, {"error": "overloaded"}
            if path not in self.routes:
                return 404, {"detail": "Not Found"}
            return self.routes[path](body, self)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _reply(self, body: dict | None):
                status, payload = server._answer(self.path, body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def do_GET(self):
                self._reply(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._reply(json.loads(self.rfile.read(length) or b"null"))

        return Handler


def free_port() -> int:
    """A port nothing listens on (bound and released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- SGLang ------------------------------------------------------------------------------------


def sglang_routes(
    model_path=FIXTURE_MODEL, routing: bool = True, server_args: dict | None = None, cached_tokens: int = 0
) -> dict:
    """Routes of an SGLang 0.5.23 server serving the fixture model.

    `/generate` replays the recorded greedy answer (resp_greedy.json) for its prompt. Any other
    prompt (the engine's readiness probe, concurrency tests) gets that answer cut to the request:
    the first max_new_tokens recorded tokens and one recorded routing row per forwarded position,
    in SGLang's format. With `routing=False` the server behaves as one started without
    --enable-return-routed-experts. Every answer reports `cached_tokens` prefix-cache hits.
    """
    greedy = load_fixture("resp_greedy")
    recorded = np.frombuffer(base64.b64decode(greedy["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, 2, 2)
    args = {
        "model_path": str(model_path),
        "dtype": "float32",
        "tp_size": 1,
        "enable_return_routed_experts": routing,
        "disable_radix_cache": True,
        "enable_eplb": False,
        "ep_num_redundant_experts": 0,
        "enable_deterministic_inference": True,
        "version": "0.5.23",
        **(server_args or {}),
    }

    def generate(body, server):
        if body["input_ids"] == FIXTURE_PROMPT and body["sampling_params"]["max_new_tokens"] == 5:
            answer = json.loads(json.dumps(greedy))
        else:
            steps = body["sampling_params"]["max_new_tokens"]
            rows = len(body["input_ids"]) + steps - 1
            answer = json.loads(json.dumps(greedy))
            answer["output_ids"] = greedy["output_ids"][:steps]
            meta = answer["meta_info"]
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:steps]
            meta["prompt_tokens"], meta["completion_tokens"] = len(body["input_ids"]), steps
            tiled = np.resize(recorded, (rows, 2, 2)).astype("<i4")
            meta["routed_experts"] = base64.b64encode(tiled.tobytes()).decode()
        answer["meta_info"]["cached_tokens"] = cached_tokens
        if not (routing and body.get("return_routed_experts")):
            answer["meta_info"].pop("routed_experts", None)
        if body.get("top_logprobs_num"):
            entries = answer["meta_info"]["output_token_logprobs"]
            answer["meta_info"]["output_top_logprobs"] = [[e] for e in entries]  # greedy: sampled = top-1
        return 200, answer

    return {
        "/get_model_info": lambda body, s: (
            200,
            {"model_path": str(model_path), "is_generation": True, "weight_version": "default"},
        ),
        "/get_server_info": lambda body, s: (200, args),
        "/generate": generate,
    }
