"""Shared test fixtures: tiny models built locally (random init, fixed seed) and the recorded SGLang fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SGLANG_FIXTURE = REPO / "tests" / "fixtures" / "sglang-0.5.23"
DEMO_MOE = REPO / "mismatch_probe" / "data" / "models" / "moe"
DEMO_DENSE = REPO / "mismatch_probe" / "data" / "models" / "dense"
DEMO_PROMPTS = REPO / "mismatch_probe" / "data" / "prompts" / "demo.jsonl"

torch.set_num_threads(1)


def _save_tiny(path: Path, moe: bool, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    if moe:
        config = Qwen3MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """Qwen3-MoE with a dense layer in the middle (layers 0 and 2 are MoE)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-moe"), moe=True)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-dense"), moe=False)


@pytest.fixture(scope="session")
def sglang_model() -> Path:
    return SGLANG_FIXTURE / "model"
