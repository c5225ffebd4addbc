"""`hf` generate computes log-probs step by step from the raw logits; they must equal what
generate's `output_logits=True` path (every step's logits kept to the end) gives for the same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_probe.engines import inference_engine
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.forward.logprobs import logprobs_from_logits
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

PROMPTS = [PromptRequest(4, 0, [5, 6, 7, 8, 9]), PromptRequest(5, 1, [11, 12])]


def old_path(engine, params: SamplingParams):
    """generate with output_logits=True, every step's logits kept, reduced afterwards; sampled through transformers'
    own top-k and top-p warpers, which the engine replaces by its TruncationProcessor (the same rule: same tokens)."""
    width = max(len(r.prompt_ids) for r in PROMPTS)
    ids = torch.full((len(PROMPTS), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(PROMPTS):
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    config = engine._generation_config(params)
    config.output_logits = True
    if params.temperature > 0:
        config.top_p, config.top_k = params.top_p, params.top_k
    torch.manual_seed(params.seed * 1_000_003 + PROMPTS[0].sample_id)
    out = engine.hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out.sequences[:, width:], torch.stack(out.logits, dim=1)  # [B, G], [B, G, V]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=7, seed=2),  # processors edit the scores
        SamplingParams(temperature=0.0, max_new_tokens=5),
    ],
)
def test_step_capture_equals_output_logits_path(tiny_moe, dtype, params):
    engine = inference_engine("hf", load_model_info(tiny_moe), EngineConfig(dtype=dtype))
    records = engine.generate(PROMPTS, params)
    sampled, logits = old_path(engine, params)
    t = params.scoring_temperature
    lp, top_id, top_lp = logprobs_from_logits(logits.flatten(0, 1), sampled.flatten(), t)
    naive = torch.log_softmax(logits.double() / t, dim=-1)
    for row, rec in enumerate(records):
        n = len(rec) - rec.prompt_len
        assert rec.token_ids[rec.prompt_len :].tolist() == sampled[row, :n].tolist()  # same seed, same tokens
        got = rec.logprob[rec.prompt_len :]
        # Same reduction on the same float32 logits: bitwise.
        np.testing.assert_array_equal(got, lp.view(len(PROMPTS), -1)[row, :n].numpy())
        np.testing.assert_array_equal(rec.top_token_id[rec.prompt_len :], top_id.view(len(PROMPTS), -1)[row, :n])
        np.testing.assert_array_equal(rec.top_logprob[rec.prompt_len :], top_lp.view(len(PROMPTS), -1)[row, :n])
        # A second implementation in float64: equal to float32 rounding.
        expected = naive[row, torch.arange(n), sampled[row, :n]].numpy()
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
        assert (got < 0).all()
    if params.top_k:  # the top-k warper sets the rest to -inf: a capture of edited scores could not be finite here
        assert np.isfinite(np.concatenate([r.top_logprob for r in records])).all()


def test_capture_hook_is_removed(tiny_dense):
    engine = inference_engine("hf", load_model_info(tiny_dense), EngineConfig(dtype="fp32"))
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=3))
    assert not engine.hf._forward_hooks
