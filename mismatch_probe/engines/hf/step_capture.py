"""Per-step log-probs of transformers `generate`, computed while it runs, from the raw logits, and
which rows each step's forward served.

generate's `output_logits=True` keeps every step's `[batch, vocab]` logits until it returns:
batch x steps x vocab floats, ~80 GB for 16 samples of 8k tokens over a 152k vocabulary. Here a
forward hook on the model keeps only the current step's logits (what generate itself reads:
`outputs.logits[:, -1]`, before any logits processor or warper edits them), and a stopping
criterion, which generate calls right after it appends the sampled token, reduces them to the
sampled token's log-prob and the top-1 at once. Peak memory is one step's logits. On a GPU, the step's
log-probs, top-1, served rows and routing (the router tap's newest call) leave the device in one copy.

A batched generate keeps forwarding a row after it finished (its EOS, then padding) while other rows
still generate; those forwards belong to no rollout. The criterion tracks which rows are unfinished
and records, per step, the rows whose input to that step's forward was a prompt or a response token
that is not the row's last one: the forwards the rollout needed, as SGLang and vLLM run them.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria

from mismatch_probe.engines.base import Truncation
from mismatch_probe.engines.forward.host_copy import to_host
from mismatch_probe.engines.forward.logprobs import logprobs_from_logits
from mismatch_probe.engines.forward.truncation import kept_support, truncated_logprobs
from mismatch_probe.engines.hf.routing import RouterTap

STEP_VALUES = 5  # logprob, top_id, top_logprob, kept_logmass, served


class TruncationProcessor(LogitsProcessor):
    """Keeps exactly `kept_support(scores / T)` (the rest -inf). generate runs it in place of its own top-p/top-k
    warpers and before its temperature warper, so the support sampled from is the one `StepLogprobs` reads."""

    def __init__(self, temperature: float, truncation: Truncation):
        self.temperature = temperature
        self.truncation = truncation

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keep = kept_support(scores.float() / self.temperature, self.truncation)
        return scores.masked_fill(~keep, float("-inf"))


class StepLogprobs(StoppingCriteria):
    """A stopping criterion that never stops: it records `log_softmax(logits / T)` at the sampled
    token and at the argmax for every step (renormalised over the `truncation` support when `processed`), the
    log mass of that support (0 without truncation), and which rows the step's forward served. Use as a
    context manager around one `generate` call."""

    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float,
        eos_ids: list[int],
        tap: RouterTap | None = None,
        truncation: Truncation | None = None,
        processed: bool = False,
    ):
        self.model = model
        self.tap = tap
        self.temperature = temperature
        self.truncation = truncation or Truncation()
        self.processed = processed
        self.eos_ids = eos_ids
        self.eos: torch.Tensor | None = None
        self.step_logits: torch.Tensor | None = None
        self.unfinished: torch.Tensor | None = None  # [batch] bool: rows whose next forward is part of their rollout
        self.steps: list[tuple[torch.Tensor, ...]] = []
        self._handle = None

    def __enter__(self) -> StepLogprobs:
        self._handle = self.model.register_forward_hook(self._keep_last_logits)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self.step_logits = None

    def _keep_last_logits(self, module, args, output) -> None:
        self.step_logits = output.logits[:, -1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.step_logits is None:
            raise RuntimeError("generate appended a token without a model forward: capture out of step")
        sampled = input_ids[:, -1]
        if self.unfinished is None:  # the prefill serves every row
            self.unfinished = torch.ones_like(sampled, dtype=torch.bool)
            self.eos = torch.tensor(self.eos_ids, dtype=sampled.dtype, device=sampled.device)
        # Unfinished before this token: the forward that produced it was the row's own. The row
        # finishes at its first EOS; generate pads it afterwards, so a finished row stays finished.
        served = self.unfinished
        self.unfinished = served & ~torch.isin(sampled, self.eos)
        reduced = self._reduce(sampled)
        routing = self.tap.newest_call() if self.tap else []
        host = to_host([*reduced, served, *routing])
        self.steps.append(tuple(host[:STEP_VALUES]))
        if self.tap:
            self.tap.replace_newest_call(host[STEP_VALUES:])
        self.step_logits = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _reduce(self, sampled: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`(logprob, top_id, top_logprob, kept_logmass)` of this step."""
        if self.processed:
            return truncated_logprobs(self.step_logits, sampled, self.temperature, self.truncation)
        raw = logprobs_from_logits(self.step_logits, sampled, self.temperature)
        if self.truncation.active:
            kept = truncated_logprobs(self.step_logits, sampled, self.temperature, self.truncation)[3]
        else:
            kept = torch.zeros_like(raw[0])
        return (*raw, kept)

    def result(self, steps: int) -> tuple[torch.Tensor, ...]:
        """`(logprob, top_id, top_logprob, kept_logmass, served)`, each `[batch, steps]`: the first `steps` steps
        (generate may undo steps it ran past the stop). `served[:, s]` says whether the forward of
        step s (the prefill for s = 0) had the row's own prompt or non-final response token as input."""
        if len(self.steps) < steps:
            raise RuntimeError(f"captured {len(self.steps)} decode steps, generate returned {steps}")
        kept = self.steps[:steps]
        return tuple(torch.stack([step[i] for step in kept], dim=1) for i in range(STEP_VALUES))
