"""`kv_quant=fp8` applies one rule to decode and prefill: `probe generate` (a KV cache, left padding per window)
and `probe rescore` (one full forward, left padding per batch) of the same tokens agree within the fp32 floor,
and both agree with a hand-written attention forward of each sequence alone that rounds K (after RoPE) and V
to e4m3fn on every read, the query unrounded (vLLM's fp8 KV cache with scale 1.0)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mismatch_probe.cli import app

FP32_FLOOR = 1e-5  # generate against rescore without kv_quant: mean 4e-7, max 2.4e-6 on the demo model


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


class NaiveQwen3:
    """A Qwen3 forward written from the architecture, one unpadded sequence at a time, float32."""

    def __init__(self, folder):
        self.w = load_file(folder / "model.safetensors")
        self.c = json.loads((folder / "config.json").read_text())

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * weight

    def rope(self, x, positions):  # x [heads, T, d]; the rotate-half convention
        d = x.shape[-1]
        theta = (self.c.get("rope_parameters") or {}).get("rope_theta", self.c.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    def logprobs(self, ids: list[int], round_kv: bool) -> np.ndarray:
        """log p(ids[t] | ids[:t]) for t >= 1."""
        c, w = self.c, self.w
        heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        t = len(ids)
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        positions = torch.arange(t)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, d).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, kv_heads, d).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, kv_heads, d).transpose(0, 1)
            q = self.rope(self.rms(q, w[p + "self_attn.q_norm.weight"]), positions)
            k = self.rope(self.rms(k, w[p + "self_attn.k_norm.weight"]), positions)
            if round_kv:
                k, v = e4m3(k), e4m3(v)
            k, v = (z.repeat_interleave(heads // kv_heads, dim=0) for z in (k, v))
            scores = (q @ k.transpose(-1, -2)) / d**0.5
            attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            x = x + attn.transpose(0, 1).reshape(t, heads * d) @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        logits = self.rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
        lp = logits.log_softmax(-1)
        return lp[torch.arange(t - 1), torch.tensor(ids[1:])].numpy()


def test_generate_and_rescore_agree_with_kv_quant_and_with_a_naive_reference(tmp_path, tiny_dense):
    """~6 s. Prompts of 2 to 7 tokens: the shorter ones are left-padded, in the decode windows and in rescore."""
    prompts = tmp_path / "p.jsonl"
    lengths = (2, 7, 4, 5)
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": [2 + (3 * i + j) % 90 for j in range(n)]}) + "\n" for i, n in enumerate(lengths)
        )
    )
    run = tmp_path / "run"
    kv = ("--engine-arg", "kv_quant=fp8")
    result = probe(
        "generate", "--model", tiny_dense, "--prompts", prompts, "--out", run, "--dtype", "fp32",
        "--max-new-tokens", 10, "--samples-per-prompt", 2, *kv,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = probe("rescore", run, "--dtype", "fp32", "--name", "kv", *kv)
    assert result.exit_code == 0, result.output

    def table(folder):
        return pl.read_parquet(folder / "*.parquet").sort("sample_id", "position")

    rollout, scored = table(run / "rollout"), table(run / "scores" / "kv")
    assert rollout["token_id"].equals(scored["token_id"])
    response = rollout["is_response"].to_numpy()
    decode, prefill = rollout["logprob"].to_numpy()[response], scored["logprob"].to_numpy()[response]
    assert len(decode) >= 40 and np.abs(decode - prefill).max() < FP32_FLOOR

    naive = NaiveQwen3(tiny_dense)
    for sample_id, rows in rollout.group_by("sample_id", maintain_order=True):
        ids = rows["token_id"].to_list()
        mask = rows["is_response"].to_numpy()[1:]
        got = rows["logprob"].to_numpy()[1:][mask]
        rounded, plain = naive.logprobs(ids, round_kv=True)[mask], naive.logprobs(ids, round_kv=False)[mask]
        assert np.abs(got - rounded).max() < FP32_FLOOR, sample_id
        assert np.abs(got - plain).max() > 1e-3, sample_id  # the rounding is there to be seen
