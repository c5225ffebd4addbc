"""Rescore throughput: the megatron engine vs a plain transformers full forward, fp32 and bf16.

    .venv/bin/python benchmarks/bench_rescore.py [--model DIR] [--batch 8] [--seq-len 256] [--repeats 3]

Prints tokens/s (all positions forwarded, prompt included) per engine and dtype.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.engines.forward.logprobs import logprobs_from_logits
from mismatch_probe.engines.megatron.training import MegatronTrainingEngine
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import ScoreRequest

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sglang-0.5.23" / "model"


def default_model() -> Path:
    embedded = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
    return embedded if (embedded / "config.json").is_file() else FIXTURE


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model())
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    info = load_model_info(args.model)
    rng = np.random.default_rng(0)
    batch = [
        ScoreRequest(i, i, rng.integers(0, info.vocab_size, args.seq_len), args.seq_len // 4) for i in range(args.batch)
    ]
    ids = torch.as_tensor(np.stack([r.token_ids for r in batch]))
    tokens = ids.numel()
    print(
        f"model {args.model} ({info.architecture}), batch {args.batch} x {args.seq_len} tokens, {torch.get_num_threads()} threads"
    )

    from transformers import AutoModelForCausalLM

    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = MegatronTrainingEngine(info, EngineConfig(dtype=dtype))
        seconds = timed(lambda engine=engine: engine.score(batch, ScoreOptions(temperature=1.0)), args.repeats)
        print(f"megatron  {dtype}: {tokens / seconds:10.0f} tokens/s")

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype).eval()

        @torch.no_grad()
        def hf_forward(hf=hf):
            logits = hf(ids).logits[:, :-1]
            return logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), 1.0)

        seconds = timed(hf_forward, args.repeats)
        print(f"hf        {dtype}: {tokens / seconds:10.0f} tokens/s")


if __name__ == "__main__":
    main()
