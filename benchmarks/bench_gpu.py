"""GPU throughput: probe's engines against plain transformers on the same model and batch (scripts/gpu_check.sh).

    python benchmarks/bench_gpu.py [--layers 8] [--hidden 1024] [--experts 32] [--top-k 4] [--vocab 32000]
        [--batch 64] [--prompt-len 64] [--new-tokens 128] [--repeats 3] [--markdown FILE]

Builds a random Qwen3-MoE of the given shape (seed 0) in a temporary folder, then times, after one warm-up
each and with CUDA synchronised around every call:
  generate  `HFInferenceEngine.generate` (log-probs + routing captured, what `probe generate --engine hf`
            runs) against plain transformers `generate` with the engine's own generation config;
  rescore   `HFTrainingEngine.score` and `MegatronTrainingEngine.score` (when megatron-core is installed),
            bf16 and fp32, against a plain transformers forward plus the log-prob gather, on the same
            [batch, prompt + new] token ids.
Prints tokens/s of each and the ratio probe / plain (1.0 = no overhead), as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mismatch_probe.engines.base import EngineConfig, SamplingParams, ScoreOptions
from mismatch_probe.engines.forward.logprobs import logprobs_from_logits
from mismatch_probe.engines.hf.inference import HFInferenceEngine
from mismatch_probe.engines.hf.training import HFTrainingEngine
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import PromptRequest, ScoreRequest

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_model(args, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        head_dim=128,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=args.vocab - 1,  # prompts never hold it; counted where sampled
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    print(f"model: random Qwen3-MoE, {params / 1e9:.2f}B parameters, {args.layers} layers, "
          f"top-{args.top_k} of {args.experts} experts, vocab {args.vocab}")  # fmt: skip
    return folder


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up, CUDA synchronised around each."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generate_rows(info, args) -> list[tuple]:
    rng = np.random.default_rng(0)
    requests = [
        PromptRequest(i, i, rng.integers(1, args.vocab - 1, args.prompt_len).tolist()) for i in range(args.batch)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    engine = HFInferenceEngine(info, EngineConfig(dtype="bf16", batch_size=args.batch))
    plain_config = engine._generation_config(params)
    plain_config.output_logits = False
    plain_config.return_dict_in_generate = False
    input_ids = torch.tensor([r.prompt_ids for r in requests]).to(engine.device)
    produced = {}

    def plain():
        torch.manual_seed(0)
        with torch.no_grad():
            out = engine.hf.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=plain_config
            )
        new = out[:, input_ids.shape[1] :].cpu().numpy()
        ended = (new == args.vocab - 1).cumsum(1) - (new == args.vocab - 1) > 0  # after the first eos
        produced["plain"] = int((~ended).sum())

    def probe():
        records = engine.generate(requests, params)
        produced["probe"] = sum(len(r) - r.prompt_len for r in records)

    plain_s, probe_s = timed(plain, args.repeats), timed(probe, args.repeats)
    label = f"hf generate bf16 (batch {args.batch}, {args.prompt_len} prompt + {args.new_tokens} new)"
    return [(label, produced["probe"] / probe_s, produced["plain"] / plain_s)]


def rescore_rows(info, args) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(1)
    length = args.prompt_len + args.new_tokens
    batch = [ScoreRequest(i, i, rng.integers(1, args.vocab - 1, length), args.prompt_len) for i in range(args.batch)]
    tokens = args.batch * length
    options = ScoreOptions(temperature=1.0)
    rows = []
    engines = {"hf": HFTrainingEngine}
    try:
        from mismatch_probe.engines.megatron.training import MegatronTrainingEngine

        engines["megatron"] = MegatronTrainingEngine
    except ImportError as exc:
        print(f"megatron: not measured ({exc})")
    for dtype, torch_dtype in DTYPES.items():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        hf = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch_dtype).to(device).eval()
        ids = torch.as_tensor(np.stack([r.token_ids for r in batch])).to(device)

        @torch.no_grad()
        def plain(hf=hf, ids=ids):
            logits = hf(ids).logits[:, :-1]
            return logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), 1.0)

        plain_tps = tokens / timed(plain, args.repeats)
        del hf
        for name, cls in engines.items():
            engine = cls(info, EngineConfig(dtype=dtype, batch_size=args.batch))
            probe_tps = tokens / timed(lambda engine=engine: engine.score(batch, options), args.repeats)
            rows.append((f"{name} rescore {dtype} (batch {args.batch} x {length})", probe_tps, plain_tps))
            del engine
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def table(rows: list[tuple]) -> str:
    lines = ["| figure | probe tokens/s | plain transformers tokens/s | probe / plain |", "|---|---|---|---|"]
    lines += [f"| {label} | {probe:,.0f} | {plain:,.0f} | {probe / plain:.2f} |" for label, probe, plain in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", type=Path, help="Also write the table to this file.")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA device)"
    print(f"device: {device}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        info = load_model_info(build_model(args, Path(tmp)))
        rows = generate_rows(info, args) + rescore_rows(info, args)
    text = table(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(f"device: {device}, torch {torch.__version__}\n\n{text}\n")


if __name__ == "__main__":
    main()
