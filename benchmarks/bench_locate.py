"""Cost of `probe locate` on a 2-layer slice of a real-shaped MoE config (Qwen3-30B-A3B's layer shapes:
hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of 768, top 8, vocabulary 151,936), random
weights saved in bf16, on a synthetic run of SEQUENCES sequences: wall time and peak resident memory.

    python benchmarks/bench_locate.py OUT [--experts 128] [--sequences 8] [--a hf:bf16] [--b hf:fp32]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def slice_model(out: Path, experts: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=experts,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.02,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    del model
    return out


def main() -> None:
    from mismatch_probe.locate.job import LocateJob, run_locate
    from mismatch_probe.testing.synthetic import SyntheticSpec, write_synthetic_run

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--a", default="hf:bf16")
    parser.add_argument("--b", default="hf:fp32")
    args = parser.parse_args()
    model = args.out / "model"
    if not (model / "config.json").is_file():
        slice_model(model, args.experts)
    run = args.out / "run"
    if not (run / "manifest.json").is_file():
        spec = SyntheticSpec(
            num_layers=2,
            top_k=8,
            num_experts=args.experts,
            n_samples=args.sequences,
            prompt_len=(64, 64),
            response_len=(128, 128),
            vocab_size=151936,
        )
        write_synthetic_run(run, spec)
    started = time.perf_counter()
    result = run_locate(
        LocateJob(
            run=run,
            a=f"{args.a}:model={model}",
            b=f"{args.b}:model={model}",
            worst=args.sequences // 2,
            samples=args.sequences - args.sequences // 2,
            batch_size=4,
            quiet=True,
        )
    )
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    print(
        json.dumps(
            {
                "seconds": round(seconds, 1),
                "peak_rss_gib": round(peak, 2),
                "tokens": result.tokens,
                "sequences": len(result.choice.sample_ids),
                "threads": torch.get_num_threads(),
                "sentence": result.verdict.sentence,
            }
        )
    )


if __name__ == "__main__":
    main()
