"""HTTP plumbing shared by the server engines: JSON calls with retries, bounded concurrency."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from mismatch_probe.errors import EngineFailure, ProbeError

log = logging.getLogger("mismatch_probe")

# Worth another try: the server is restarting, overloaded or briefly unreachable.
RETRY_STATUS = {429, 500, 502, 503, 504}


class ServerDown(Exception):
    """No HTTP answer at all (connection refused, DNS, timeout) after every retry."""

    def __init__(self, request: str, problem: str, attempts: int, timed_out: bool):
        super().__init__(f"{request}: {problem} after {attempts} attempts")
        self.request, self.problem, self.attempts, self.timed_out = request, problem, attempts, timed_out


class NotFound(EngineFailure):
    """The server answered 404: it does not have this endpoint (another server, another version)."""


@dataclass
class ServerClient:
    """A `requests.Session` bound to one server, with the retry policy of the probe.

    Connection errors, timeouts and 429/5xx answers are retried with exponential backoff
    (`backoff_s`, doubled each time, at most 30 s); other 4xx answers fail at once.
    """

    base_url: str
    label: str  # "SGLang", "vLLM": names the server in every message
    timeout_s: float = 600.0
    max_retries: int = 4
    concurrency: int = 8
    backoff_s: float = 1.0
    session: requests.Session = field(init=False, repr=False)

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/")
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=max(1, self.concurrency))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def get(self, path: str, retries: int | None = None, timeout_s: float | None = None) -> dict:
        return self._call("GET", path, None, retries, timeout_s)

    def post(self, path: str, body: dict, retries: int | None = None, timeout_s: float | None = None) -> dict:
        return self._call("POST", path, body, retries, timeout_s)

    def _call(self, method: str, path: str, body: dict | None, retries: int | None, timeout_s: float | None) -> dict:
        url = self.base_url + path
        attempts = 1 + (self.max_retries if retries is None else retries)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        problem, timed_out = "", False
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(30.0, self.backoff_s * 2 ** (attempt - 1)))
            try:
                reply = self.session.request(method, url, json=body, timeout=timeout_s)
            except requests.ConnectTimeout:  # nothing accepted the connection: unreachable, not slow
                problem, timed_out = f"connection not accepted within {timeout_s:g} s", False
                continue
            except requests.Timeout:
                problem, timed_out = f"no answer within {timeout_s:g} s", True
                continue
            except requests.ConnectionError as exc:
                problem, timed_out = f"connection failed ({_short(exc)})", False
                continue
            if reply.status_code in RETRY_STATUS:
                problem = f"HTTP {reply.status_code}: {_short(reply.text)}"
                log.debug("%s %s -> %s, retrying", method, url, problem)
                continue
            if reply.status_code == 404:
                raise NotFound(f"{self.label} server at {self.base_url} has no {method} {path} (HTTP 404)")
            if reply.status_code >= 400:
                raise EngineFailure(
                    f"{self.label} server at {self.base_url}: {method} {path} was refused "
                    f"(HTTP {reply.status_code}: {_short(reply.text)})"
                )
            try:
                return reply.json()
            except ValueError:
                raise EngineFailure(
                    f"{self.label} server at {self.base_url}: {method} {path} did not answer JSON "
                    f"({_short(reply.text)})"
                ) from None
        if problem.startswith("HTTP"):
            raise EngineFailure(
                f"{self.label} server at {self.base_url}: {method} {path} failed after {attempts} attempts ({problem})"
            )
        raise ServerDown(f"{method} {url}", problem, attempts, timed_out)

    def map(self, fn: Callable, items: Iterable) -> list:
        """`[fn(x) for x in items]` with at most `concurrency` calls in flight, in input order."""
        items = list(items)
        if len(items) <= 1 or self.concurrency <= 1:
            return [fn(item) for item in items]
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(items)))
        futures = [pool.submit(fn, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            # One failure ends the window: don't keep the others retrying against a dead server.
            for future in futures:
                future.cancel()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def generation_failure(self, exc: ServerDown) -> EngineFailure:
        return EngineFailure(f"{self.label} server at {self.base_url} stopped answering during generation: {exc}")

    def unreachable(self, down: ServerDown, launch: str, hint: str) -> ProbeError:
        """The readiness error: a server that never answered, or none listening at all."""
        if down.timed_out:
            return ProbeError(
                f"{self.label} server at {self.base_url} accepted the connection but {down.request} got "
                f"{down.problem} ({down.attempts} attempts): it is still starting or is stuck; check its log, "
                f"or wait longer with {hint}"
            )
        return ProbeError(f"cannot reach {self.label} server at {self.base_url}: start it with `{launch}`")

    def host_port(self) -> tuple[str, int]:
        """Host and port of the base URL (the scheme's default port when it names none)."""
        url = urlsplit(self.base_url)
        return url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80)

    def close(self) -> None:
        self.session.close()


def _short(value, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def model_name(path_or_id: str | Path) -> str:
    """The checkpoint's name as a server may report it: a path's last part, a hub id's name.

    A hub cache path `.../models--Org--Name/snapshots/<hash>` counts as `Name`.
    """
    parts = Path(str(path_or_id).rstrip("/")).parts
    for part in parts:
        if part.startswith("models--"):
            return part.split("--")[-1]
    return parts[-1] if parts else ""


def same_model(server_model: str, local_path: Path) -> bool:
    """Same path, or same name: the server usually runs on another machine with another file
    layout, so the name is all the two sides can share."""
    local = Path(local_path).resolve()
    return str(server_model).rstrip("/") == str(local) or model_name(server_model) == model_name(local)
