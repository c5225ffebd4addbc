"""Cost of capturing routing and log-probs during `hf` generation.

    .venv/bin/python benchmarks/bench_capture.py [--model DIR] [--batch 8] [--prompt-len 32]
        [--new-tokens 64] [--repeats 7]

Three ways to generate the same tokens (same seed, same sampling), interleaved A B C A B C...:
  plain    transformers `generate` as a user would call it: no logits kept, no hooks (the hook-free
           engine's model)
  logprobs our HFInferenceEngine with its router hooks removed: raw logits kept, log-probs gathered
  full     our HFInferenceEngine as `probe generate` runs it: log-probs + routing captured
Prints the median wall time of each and the overhead of `full` over `plain` (and over `logprobs`)
as the median and the spread (min..max) of the per-round ratios. Target: at most 5 %.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.hf.inference import HFInferenceEngine
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest

REPO = Path(__file__).resolve().parents[1]
DEMO_MOE = REPO / "mismatch_probe" / "data" / "models" / "moe"
FALLBACK = REPO / "tests" / "fixtures" / "sglang-0.5.23" / "model"


def default_model() -> Path:
    if any(DEMO_MOE.glob("*.safetensors")):
        return DEMO_MOE
    print(f"note: {DEMO_MOE} has no weights yet; using the small fixture model {FALLBACK}")
    return FALLBACK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = args.model or default_model()
    info = load_model_info(model)
    full = HFInferenceEngine(info, EngineConfig(dtype=args.dtype))
    bare = HFInferenceEngine(info, EngineConfig(dtype=args.dtype))
    bare.tap.remove()  # same engine code, no router hooks
    bare.tap = None
    rng = np.random.default_rng(0)
    requests = [
        PromptRequest(i, i, rng.integers(2, info.vocab_size - 1, args.prompt_len).tolist()) for i in range(args.batch)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    plain_config = full._generation_config(params)
    plain_config.output_logits = False
    plain_config.return_dict_in_generate = False
    input_ids = torch.tensor([r.prompt_ids for r in requests]).to(bare.device)

    def plain():
        torch.manual_seed(params.seed * 1_000_003)
        with torch.no_grad():
            return bare.hf.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=plain_config
            )

    runs = {
        "plain": plain,
        "logprobs": lambda: bare.generate(requests, params),
        "full": lambda: full.generate(requests, params),
    }
    for fn in runs.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tokens = sum(len(r.prompt_ids) for r in requests), args.batch * args.new_tokens
    print(
        f"model {model} ({info.architecture}, {info.routing.num_layers} MoE layers, top-{info.routing.top_k} "
        f"of {info.routing.num_experts}), {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
        f"up to {args.new_tokens} new tokens, {torch.get_num_threads()} threads, {args.repeats} rounds"
    )
    print(f"  ({tokens[0]} prompt tokens, up to {tokens[1]} generated per round)")
    for name, values in times.items():
        print(f"{name:9s}: median {statistics.median(values) * 1e3:8.1f} ms")
    for base in ("plain", "logprobs"):
        ratios = [100 * (f / b - 1) for f, b in zip(times["full"], times[base])]
        print(
            f"overhead of full over {base:8s}: median {statistics.median(ratios):+.1f} %, "
            f"spread {min(ratios):+.1f} .. {max(ratios):+.1f} % (per-round ratios)"
        )


if __name__ == "__main__":
    main()
