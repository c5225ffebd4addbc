"""Write tests/fixtures/import/verl_step1.pkl with verl's own DataProto.save_to_disk.

Run with verl and tensordict importable (they are not probe dependencies), e.g.
    pip install --target /tmp/verl-extra --no-deps verl==0.9.1 tensordict==0.15.3 pyvers omegaconf
    PYTHONPATH=/tmp/verl-extra python scripts/make_verl_fixture.py

The batch follows verl's agent loop (verl/experimental/agent_loop/agent_loop.py, `_postprocess`, ~line 735):
left-padded `prompts`, right-padded `responses`, `response_mask`, `input_ids`, `attention_mask`,
`rollout_log_probs` (inference) and `routed_experts` [bsz, prompt+response length, layers, top_k]; plus
`old_log_probs`, the actor's recomputed log-probs (verl/trainer/ppo/ray_trainer.py, ~line 93).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from verl.protocol import DataProto

PROMPT_LEN, RESPONSE_LEN, LAYERS, TOP_K, EXPERTS = 5, 6, 2, 2, 8
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]
RESPONSES = [[101, 102, 103, 104], [201, 202, 203, 204, 205, 206], [301]]


def build(seed: int = 0) -> DataProto:
    rng = np.random.default_rng(seed)
    bsz = len(PROMPTS)
    prompts = torch.zeros(bsz, PROMPT_LEN, dtype=torch.long)
    responses = torch.zeros(bsz, RESPONSE_LEN, dtype=torch.long)
    attention = torch.zeros(bsz, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    response_mask = torch.zeros(bsz, RESPONSE_LEN, dtype=torch.long)
    rollout_lp = torch.zeros(bsz, RESPONSE_LEN, dtype=torch.float32)
    old_lp = torch.zeros(bsz, RESPONSE_LEN, dtype=torch.float32)
    experts = torch.zeros(bsz, PROMPT_LEN + RESPONSE_LEN, LAYERS, TOP_K, dtype=torch.uint8)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        prompts[i, PROMPT_LEN - len(p) :] = torch.tensor(p)  # left padding
        responses[i, : len(r)] = torch.tensor(r)  # right padding
        attention[i, PROMPT_LEN - len(p) : PROMPT_LEN + len(r)] = 1
        response_mask[i, : len(r)] = 1
        lp = -rng.exponential(1.0, len(r)).astype(np.float32)
        rollout_lp[i, : len(r)] = torch.from_numpy(lp)
        old_lp[i, : len(r)] = torch.from_numpy(np.minimum(lp + rng.normal(0, 0.05, len(r)), 0).astype(np.float32))
        # The server returns routing for every position but the last (never forwarded); verl zero-fills the rest.
        n = len(p) + len(r) - 1
        ids = np.argsort(rng.random((n, LAYERS, EXPERTS)), axis=-1)[..., :TOP_K].astype(np.uint8)
        experts[i, PROMPT_LEN - len(p) : PROMPT_LEN - len(p) + n] = torch.from_numpy(ids)
    batch = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "rollout_log_probs": rollout_lp,
            "old_log_probs": old_lp,
            "routed_experts": experts,
        },
        batch_size=bsz,
    )
    uid = np.array(["a", "a", "b"], dtype=object)
    return DataProto(batch=batch, non_tensor_batch={"uid": uid}, meta_info={"global_steps": 1})


def expected(proto: DataProto) -> list[dict]:
    """What the dump holds per sample, unpadded, read back through verl's own DataProto (the test's answer)."""
    rows = []
    for i in range(len(proto)):
        item = proto[i].batch
        keep = item["attention_mask"].bool()
        keep_p, keep_r = keep[:PROMPT_LEN], keep[PROMPT_LEN:]
        rows.append(
            {
                "prompt_ids": item["prompts"][keep_p].tolist(),
                "response_ids": item["responses"][keep_r].tolist(),
                "inference_logprobs": item["rollout_log_probs"][keep_r].tolist(),
                "training_logprobs": item["old_log_probs"][keep_r].tolist(),
                "routed_experts": item["routed_experts"][keep].tolist(),
            }
        )
    return rows


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "tests/fixtures/import/verl_step1.pkl"
    proto = build()
    proto.save_to_disk(out)
    back = DataProto.load_from_disk(out)  # verl's own reader
    out.with_suffix(".expected.json").write_text(json.dumps(expected(back)) + "\n")
    print(out, out.stat().st_size, "bytes")
