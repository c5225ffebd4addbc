"""What the `sglang` and `vllm` engines share: their options, per-sample seeds, the readiness
calls, warnings, the launch command printed when no server answers, and the manifest entry."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mismatch_probe.engines.base import InferenceEngine, SamplingParams
from mismatch_probe.engines.options import option
from mismatch_probe.engines.serving.http_client import ServerClient, ServerDown
from mismatch_probe.errors import ProbeError
from mismatch_probe.vocab import DTYPE_ALIASES

log = logging.getLogger("mismatch_probe")


@dataclass(frozen=True)
class ServerOptions:
    server_url: str | None = option(None, "base URL of the running server, e.g. http://gpu-host:30000 (required)")
    concurrency: int = option(8, "requests in flight", min=1)
    timeout_s: float = option(600.0, "seconds to wait for each generation answer", min=0.001)
    ready_timeout_s: float = option(60.0, "seconds to wait for each readiness-check answer", min=0.001)
    max_retries: int = option(4, "retries on connection errors, timeouts and 429/5xx answers", min=0)
    retry_backoff_s: float = option(1.0, "first pause between retries, doubled each time (at most 30 s)", min=0)


@dataclass(frozen=True)
class ServerKind:
    """What tells one server program from another in messages and in its launch command."""

    label: str  # names the server in every message: "SGLang", "vLLM"
    default_port: int
    launch_program: str  # the launch command up to the model path
    launch_flags: str  # the flags the probe needs, after the model path (routing added for MoE models)


ROUTING_FLAG = "--enable-return-routed-experts"  # the same flag in SGLang and vLLM


def sampling_seed(params: SamplingParams, sample_id: int) -> int:
    """One seed per sample, so that samples of the same prompt differ and a rerun repeats them."""
    return (params.seed * 1_000_003 + sample_id) % (2**31 - 1)


def probe_dtype(reported) -> str:
    """The dtype a server reports, in the probe's names; "unknown" when it reports none or "auto"."""
    text = str(reported or "").lower().removeprefix("torch.")
    if not text or text == "auto":
        return "unknown"
    return DTYPE_ALIASES.get(text, text)


class ServerEngine(InferenceEngine):
    """An inference engine behind the HTTP API of a server the user started."""

    Options = ServerOptions
    kind: ServerKind
    writes_serving_path = True

    def __init__(self, model, config):
        super().__init__(model, config)
        if not self.options.server_url:
            raise ProbeError(
                f"--engine-arg server_url: required with --engine {self.name} "
                f"(e.g. server_url=http://127.0.0.1:{self.kind.default_port}; alias --server-url)"
            )
        self.client = ServerClient(
            base_url=self.options.server_url,
            label=self.kind.label,
            timeout_s=self.options.timeout_s,
            max_retries=self.options.max_retries,
            concurrency=self.options.concurrency,
            backoff_s=self.options.retry_backoff_s,
        )
        self.warnings: list[str] = []
        self.server_dtype = "unknown"

    @property
    def window_size(self) -> int:
        # Enough requests in flight to keep the server's batcher full.
        return self.options.concurrency * 4

    @property
    def dtype(self) -> str:
        return self.server_dtype

    @property
    def launch_command(self) -> str:
        host, port = self.client.host_port()
        routing = f" {ROUTING_FLAG}" if self.model.routing.is_moe else ""
        return (
            f"{self.kind.launch_program} {self.model.path} {self.kind.launch_flags}{routing} "
            f"--host {host} --port {port}"
        )

    def ready_get(self, path: str) -> dict:
        """A readiness GET: one retry, the readiness timeout, and the real cause when nothing answers."""
        return self._ready(self.client.get, path)

    def ready_post(self, path: str, body: dict) -> dict:
        return self._ready(self.client.post, path, body)

    def _ready(self, call, *args) -> dict:
        try:
            return call(*args, retries=1, timeout_s=self.options.ready_timeout_s)
        except ServerDown as down:
            hint = "--engine-arg ready_timeout_s=SECONDS"
            raise self.client.unreachable(down, self.launch_command, hint) from None

    def call_generate(self, path: str, body: dict) -> dict:
        try:
            return self.client.post(path, body)
        except ServerDown as down:
            raise self.client.generation_failure(down) from None

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("warning: %s", message)

    def describe_server(self, version, served_model) -> dict:
        """The manifest fields every server engine records; each adds its own."""
        return {
            "engine": self.name,
            "dtype": self.server_dtype,
            "server_url": self.client.base_url,
            "server_version": version,
            "server_model": served_model,
            "warnings": list(self.warnings),
        }

    def close(self) -> None:
        self.client.close()
