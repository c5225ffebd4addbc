"""Quantized rescore throughput: the demo MoE model's forward in bf16 with no quantization, and with
`weight_quant=fp8-block128 act_quant=fp8-token128` computed by `emulate` (float32 operands) and by `kernel`
(torch._scaled_mm per K chunk, which this torch build may run on the CPU).

    .venv/bin/python benchmarks/bench_quant.py [--model DIR] [--batch 16] [--seq-len 256] [--repeats 3]

Prints tokens/s (all positions forwarded) per compute path, median of the repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from mismatch_probe.quant.apply import quantize_model
from mismatch_probe.quant.targets import DEFAULT_SKIP

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MOE)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    ids = torch.randint(2, 500, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    print(f"model {args.model.name}, batch {args.batch} x {args.seq_len}, bf16, torch {torch.__version__}")
    for compute in (None, "emulate", "kernel"):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
        if compute is not None:
            quantize_model(model, "fp8-block128", "fp8-token128", DEFAULT_SKIP, compute=compute)
        times = []
        with torch.no_grad():
            for i in range(args.repeats + 1):
                start = time.perf_counter()
                model(ids)
                if i:  # the first is the warm-up
                    times.append(time.perf_counter() - start)
        rate = args.batch * args.seq_len / statistics.median(times)
        print(f"{compute or 'no quant':>10}: {rate:,.0f} tokens/s")


if __name__ == "__main__":
    main()
