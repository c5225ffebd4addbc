"""`hf` inference: transformers `generate` with a KV cache, routing captured by router hooks, on the
device of `--engine-arg device` (or spread by `device_map`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from mismatch_probe.engines.base import InferenceEngine, SamplingParams
from mismatch_probe.engines.forward.fingerprint import hf_fingerprint
from mismatch_probe.engines.hf.device import DeviceOptions, input_device, placement_facts
from mismatch_probe.engines.hf.knobs import KnobOptions, apply_knobs
from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.engines.hf.quant_options import QuantOptions
from mismatch_probe.engines.hf.routing import attach_router_tap
from mismatch_probe.engines.hf.step_capture import StepLogprobs, TruncationProcessor
from mismatch_probe.model.generation import as_ids
from mismatch_probe.rundir.records import PromptRequest, SequenceRecord
from mismatch_probe.vocab import FINGERPRINT_KEY, LOGPROBS_MODES, PROCESSED


@dataclass(frozen=True)
class HFInferenceOptions(KnobOptions, QuantOptions, DeviceOptions):
    """Where the model runs, how its rollout is quantized, and its knobs (engines/hf/knobs.py)."""

    def __post_init__(self) -> None:
        DeviceOptions.__post_init__(self)
        self.check_quant()
        self.check_knobs()


class HFInferenceEngine(InferenceEngine):
    name = "hf"
    Options = HFInferenceOptions
    logprobs_modes = LOGPROBS_MODES
    writes_kept_logmass = True

    def __init__(self, model, config):
        super().__init__(model, config)
        self.hf = load_hf_model(model, config.dtype, self.options)
        self.fingerprint = hf_fingerprint(self.hf, model.vocab_size)  # the checkpoint's, before any quantization
        self.quantized = self.options.quantize(self.hf, model.path)
        self.knobs = apply_knobs(self.hf, model, self.options)  # inside generate too: its LM head, routers, attention
        self.device = input_device(self.hf)
        self.tap = attach_router_tap(self.hf, model)
        self.writes_router_margin = self.tap is not None
        gen = self.hf.generation_config
        self.eos_ids = as_ids(gen.eos_token_id)  # the checkpoint's, whatever the load path (model/generation.py)
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else (self.eos_ids or [0])[0]

    def end_ids(self) -> list[int]:
        return list(self.eos_ids)

    def describe(self) -> dict:
        weights = {FINGERPRINT_KEY: self.fingerprint}
        return super().describe() | placement_facts(self.hf, self.options) | self.knobs.describe() | weights

    def quantization(self) -> dict | None:
        return self.quantized

    @torch.no_grad()
    def generate(self, requests: list[PromptRequest], params: SamplingParams) -> list[SequenceRecord]:
        batch = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding, as generate expects
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention[row, width - len(request.prompt_ids) :] = 1
        # Seeded per window so that a resumed run regenerates exactly what an uninterrupted one would.
        torch.manual_seed(params.seed * 1_000_003 + requests[0].sample_id)
        if self.tap:
            self.tap.reset()
        # A truncated sampler draws through probe's own support rule, so the support whose mass is written
        # is exactly the one sampled from (engines/forward/truncation.py; HF's warpers state the same rule).
        truncation = params.truncation
        processors = [TruncationProcessor(params.temperature, truncation)] if truncation.active else []
        processed = params.logprobs_mode == PROCESSED
        capture = StepLogprobs(self.hf, params.scoring_temperature, self.eos_ids, self.tap, truncation, processed)
        with capture:
            out = self.hf.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=self._generation_config(params),
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([capture]),
            )
        sampled = out.sequences[:, width:].cpu()
        steps = sampled.shape[1]
        logprob, top_id, top_logprob, kept, served = capture.result(steps)
        routing = self._routing(batch, width, steps, attention, served)
        return [
            self._record(r, row, width, sampled[row], (logprob[row], top_id[row], top_logprob[row], kept[row]), routing)
            for row, r in enumerate(requests)
        ]

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # A fresh config: nothing from the checkpoint's generation_config.json leaks into sampling.
        # top-p and top-k are applied by TruncationProcessor; generate's own warpers stay off. They are set, not
        # None: transformers 5 fills a None from the checkpoint's generation_config, then its default top_k 50.
        sample = params.temperature > 0
        return GenerationConfig(
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=1.0,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.pad_id,
            use_cache=True,
            return_dict_in_generate=True,
        )

    def _routing(self, batch, width, steps, attention, served) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """`[batch, width + steps - 1, layers, k]` expert ids, `[..., layers]` router margins and the
        `[batch, width + steps - 1]` mask of the positions whose forward the rollout needed, in padded
        coordinates: real prompt tokens, and response tokens after which the row went on. The last
        sampled token is never among them, and neither is a finished row's EOS that generate still
        forwards while other rows of the batch generate."""
        if not self.tap:
            return None
        forwarded = _per_position(self.tap.layer_calls(), batch, width)
        assert forwarded.shape[1] == width + steps - 1, "router calls do not match decode steps"
        margins = _per_position([[m[:, None] for m in calls] for calls in self.tap.layer_margins()], batch, width)
        needed = np.concatenate([attention.bool().numpy(), served[:, 1:steps].numpy()], axis=1)
        return forwarded.astype(self.model.routing.id_dtype), margins[..., 0], needed

    def _record(self, request, row, width, sampled, step_values, routing) -> SequenceRecord:
        logprob, top_id, top_logprob, kept = step_values
        response = sampled.numpy()
        ends = np.flatnonzero(np.isin(response, self.eos_ids))
        length = int(ends[0]) + 1 if ends.size else len(response)  # keep the EOS token itself
        prompt_len = len(request.prompt_ids)
        n = prompt_len + length
        token_ids = np.concatenate([np.asarray(request.prompt_ids, dtype=np.int64), response[:length]])
        scored = np.arange(n) >= prompt_len

        def pad_lp(values):
            return np.concatenate([np.zeros(prompt_len, np.float32), values[:length].numpy()])

        record = SequenceRecord(
            sample_id=request.sample_id,
            prompt_id=request.prompt_id,
            token_ids=token_ids,
            prompt_len=prompt_len,
            logprob=pad_lp(logprob),
            logprob_valid=scored,
            top_token_id=np.concatenate([np.zeros(prompt_len, np.int64), top_id[:length].numpy()]),
            top_logprob=pad_lp(top_logprob),
            kept_logmass=pad_lp(kept),
        )
        if routing is not None:
            ids, margins, needed = routing
            span = slice(width - prompt_len, width - prompt_len + n)
            have = needed[row, span]  # one short of n when the response ran to max_new_tokens
            valid = np.zeros(n, dtype=bool)
            valid[: len(have)] = have
            record.experts = np.zeros((n, *ids.shape[2:]), dtype=ids.dtype)
            record.experts[valid] = ids[row, span][have]
            record.router_margin = np.zeros((n, margins.shape[2]), dtype=np.float32)
            record.router_margin[valid] = margins[row, span][have]
            record.experts_valid = valid
        return record


def _per_position(layer_calls: list[list[torch.Tensor]], batch: int, width: int) -> np.ndarray:
    """`[batch, width + decode steps, layers, ...]` from each layer's prefill call and its one-token decode calls."""
    layers = []
    for calls in layer_calls:
        prefill = calls[0].view(batch, width, -1)
        decode = [c.view(batch, 1, -1) for c in calls[1:]]
        layers.append(torch.cat([prefill, *decode], dim=1))
    return torch.stack(layers, dim=2).numpy()
