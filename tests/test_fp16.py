"""fp16 in the hf engines: weights and compute in float16, log-probs close to fp32."""

from __future__ import annotations

import numpy as np
import torch

from mismatch_probe.engines import inference_engine, training_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest


def test_fp16_generate_and_score_track_fp32(tiny_moe):
    info = load_model_info(tiny_moe)
    inference = inference_engine("hf", info, EngineConfig(dtype="fp16", batch_size=2))
    assert inference.hf.dtype == torch.float16
    rollout = inference.generate(
        [PromptRequest(0, 0, [5, 6, 7]), PromptRequest(1, 1, [9, 4])],
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=2),
    )
    batch = [ScoreRequest(r.sample_id, r.prompt_id, r.token_ids, r.prompt_len) for r in rollout]
    scores = {}
    for dtype in ("fp16", "fp32"):
        engine = training_engine("hf", info, EngineConfig(dtype=dtype))
        assert engine.hf.dtype == (torch.float16 if dtype == "fp16" else torch.float32)
        scores[dtype] = engine.score(batch, ScoreOptions(temperature=1.0))
    for sampled, half, full in zip(rollout, scores["fp16"], scores["fp32"]):
        response = slice(sampled.prompt_len, None)
        assert np.isfinite(half.logprob[response]).all()
        # fp16 keeps 11 mantissa bits: its log-probs differ from fp32, but only slightly
        diff = np.abs(half.logprob[response] - full.logprob[response])
        assert 0 < diff.max() < 0.05
        assert np.abs(sampled.logprob[response] - full.logprob[response]).max() < 0.05
        assert half.experts.shape == full.experts.shape
