"""Peak memory of `hf` generate over a 152k vocabulary: per-step capture (the probe's) vs keeping every step's logits.

    .venv/bin/python benchmarks/bench_generate_memory.py [--steps 256 1024 4096] [--batch 2] [--vocab 151936]

Model: a tiny random dense Qwen3 (hidden 64, 2 layers) with the given vocabulary and no EOS token, so
every sample runs the full number of steps. Each measurement runs in a fresh child process, which
loads the model, reads its peak RSS (ru_maxrss), generates, and reads it again; the difference is
what generation itself needed. Children run with MALLOC_MMAP_THRESHOLD_=65536 (every block over
64 KiB is its own mapping, returned when freed): with glibc's default adaptive threshold the freed
per-step logits stay in the heap, and the figure for the same run varies by several hundred MB
from one run to the next. `--glibc-default` measures without it.

after  = `HFInferenceEngine.generate`: a forward hook keeps one step's logits and a stopping criterion
         reduces them to the sampled token's log-prob and the top-1 as soon as the token is sampled.
before = the path the engine used before per-step capture: `generate(output_logits=True)`, which keeps
         every step's float32 `[batch, vocab]` logits, reduced once generation returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

MB = 1e6


def peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def save_model(path: str, vocab: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=8192,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)


def child(mode: str, path: str, steps: int, batch: int) -> None:
    import torch

    from mismatch_probe.engines import inference_engine
    from mismatch_probe.engines.base import EngineConfig, SamplingParams
    from mismatch_probe.engines.forward.logprobs import logprobs_from_logits
    from mismatch_probe.model.routing_shape import load_model_info
    from mismatch_probe.rundir.records import PromptRequest

    torch.set_num_threads(1)
    engine = inference_engine("hf", load_model_info(path), EngineConfig(dtype="fp32", batch_size=batch))
    params = SamplingParams(temperature=1.0, max_new_tokens=steps, seed=0)
    requests = [PromptRequest(i, i, [3 + i, 4, 5, 6]) for i in range(batch)]
    before = peak_rss()
    with torch.no_grad():
        if mode == "after":
            records = engine.generate(requests, params)
            check = sum(float(r.logprob.sum()) for r in records)
        else:
            config = engine._generation_config(params)
            config.output_logits = True
            ids = torch.tensor([r.prompt_ids for r in requests])
            out = engine.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            check = reduce_in_blocks(out.logits, out.sequences[:, 4:], logprobs_from_logits)
    print(json.dumps({"extra": peak_rss() - before, "loaded": before, "check": check}))


def reduce_in_blocks(logits: tuple, sampled, reduce) -> float:
    """The old engine's reduction: steps stacked a block at a time (16M floats), so the kept logits dominate."""
    import torch

    batch, vocab = logits[0].shape
    block = max(1, (1 << 24) // (batch * vocab))
    total = 0.0
    for start in range(0, len(logits), block):
        chunk = torch.stack(logits[start : start + block], dim=1)
        targets = sampled[:, start : start + chunk.shape[1]]
        total += float(reduce(chunk.reshape(-1, vocab), targets.reshape(-1), 1.0)[0].sum())
    return total


def measure(mode: str, path: str, steps: int, batch: int, glibc_default: bool) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--model", path, "--steps", str(steps), "--batch", str(batch)]
    env = dict(os.environ) if glibc_default else {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold")
    parser.add_argument("--child", choices=["before", "after"])
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.steps[0], args.batch)
        return
    with tempfile.TemporaryDirectory() as path:
        save_model(path, args.vocab)
        malloc = "glibc default malloc" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=65536"
        print(f"vocab {args.vocab}, batch {args.batch}, {malloc}; MB of peak RSS added by generation")
        print(f"{'steps':>6} {'before':>10} {'after':>10} {'B*G*V*4':>10}")
        for steps in args.steps:
            old, new = (measure(mode, path, steps, args.batch, args.glibc_default) for mode in ("before", "after"))
            floor = args.batch * steps * args.vocab * 4
            print(f"{steps:>6} {old['extra'] / MB:>10.0f} {new['extra'] / MB:>10.0f} {floor / MB:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
