"""Peak memory of each hf rescore pass on a slice of a Qwen3-MoE model, and the log-probs each pass gives.

    .venv/bin/python benchmarks/bench_pass_memory.py [--layers 1,2] [--hidden 1024] [--experts 64]
        [--moe-intermediate 384] [--vocab 32768] [--work DIR] [--save-logprobs DIR] [--compare DIR]

Method: the slice (Qwen3-30B-A3B's attention shapes, 32 heads of 128 with 4 KV heads, at the given hidden size,
expert count and vocabulary; random bf16 weights, seed 0) is saved with save_pretrained, and an FP8 copy of it
(e4m3 codes and 128x128 `weight_scale_inv` of every linear but the routers and the LM head) beside it. Each pass
runs in its own child process, which builds the hf training engine with the pass's --dtype and engine args,
scores 4 sequences of 16 tokens, and reports its peak resident memory (ru_maxrss). The table gives each pass's
peak per layer count, its growth per added layer, and that growth against the bf16 pass's (the matched pass).

--save-logprobs writes each pass's log-probs (one .npy per pass and layer count); --compare reads such a folder
and says, pass by pass, whether today's log-probs are bit-identical to those.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

GB = 1e9
FP8_BLOCK = 128
PASSES = {  # name: (dtype, engine args, the model: "plain" or the FP8 copy)
    "bf16": ("bf16", {}, "plain"),
    "fp32": ("fp32", {}, "plain"),
    "fp32-bf16w": ("fp32-bf16w", {}, "plain"),
    "knobs-fp32": ("bf16", {"lm_head_dtype": "fp32", "router_dtype": "fp32"}, "plain"),
    "fp8-block128": ("bf16", {"weight_quant": "fp8-block128"}, "plain"),
    "fp8-block128+token128": ("bf16", {"weight_quant": "fp8-block128", "act_quant": "fp8-token128"}, "plain"),
    "fp8-kernel": (
        "bf16",
        {"weight_quant": "fp8-block128", "act_quant": "fp8-token128", "quant_compute": "kernel"},
        "plain",
    ),
    "int4-g128": ("bf16", {"weight_quant": "int4-g128"}, "plain"),
    "fp8-checkpoint": ("bf16", {}, "fp8"),
    "fp8-checkpoint-kernel": ("bf16", {"weight_quant": "checkpoint:{model}", "quant_compute": "kernel"}, "fp8"),
    "dequantized": ("bf16", {"weight_quant": "dequantized"}, "fp8"),
}


def peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_slice(folder: Path, layers: int, args) -> None:
    """The bf16 slice in `folder`/plain and its FP8 copy in `folder`/fp8 (skipped when already there)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    plain, fp8 = folder / "plain", folder / "fp8"
    if (fp8 / "config.json").exists():
        return
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=args.moe_intermediate * 8,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(plain)
    del model
    state = load_file(plain / "model.safetensors")
    stored = {}
    for name, tensor in state.items():
        if not name.endswith("proj.weight") or tensor.dim() != 2:
            stored[name] = tensor  # embeddings, norms, routers (mlp.gate), lm_head stay bf16
            continue
        w = tensor.float()
        rows, cols = w.shape
        nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
        padded = torch.nn.functional.pad(w, (0, nc * FP8_BLOCK - cols, 0, nr * FP8_BLOCK - rows))
        absmax = padded.reshape(nr, FP8_BLOCK, nc, FP8_BLOCK).abs().amax(dim=(1, 3))
        scale_inv = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 448)
        full = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
        stored[name], stored[f"{name}_scale_inv"] = (w / full).to(torch.float8_e4m3fn), scale_inv
    fp8.mkdir(parents=True, exist_ok=True)
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((plain / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (fp8 / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in ("generation_config.json",):
        if (plain / extra).exists():
            (fp8 / extra).write_text((plain / extra).read_text())


def child(name: str, model_dir: str, out: str) -> None:
    import torch

    from mismatch_probe.engines.base import EngineConfig, ScoreOptions
    from mismatch_probe.engines.hf.training import HFTrainingEngine
    from mismatch_probe.model.routing_shape import load_model_info
    from mismatch_probe.rundir.records import ScoreRequest

    torch.set_num_threads(2)
    dtype, engine_args, _ = PASSES[name]
    info = load_model_info(model_dir)
    engine_args = {key: value.replace("{model}", model_dir) for key, value in engine_args.items()}
    engine = HFTrainingEngine(info, EngineConfig(dtype=dtype, engine_args=engine_args))
    loaded = peak_rss()
    generator = np.random.default_rng(0)
    batch = [
        ScoreRequest(sample_id=i, prompt_id=i, token_ids=generator.integers(2, info.vocab_size, 16), prompt_len=4)
        for i in range(4)
    ]
    records = engine.score(batch, ScoreOptions(temperature=1.0))
    logprobs = np.concatenate([r.logprob[r.logprob_valid] for r in records])
    np.save(out, logprobs)
    print(json.dumps({"peak": peak_rss(), "loaded": loaded}))


def run_pass(name: str, model_dir: Path, out: Path) -> dict:
    command = [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--moe-intermediate", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--passes", default=",".join(PASSES), help="comma-separated pass names")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_pass_memory"))
    parser.add_argument("--save-logprobs", type=Path, default=None)
    parser.add_argument("--compare", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model_dir, args.out)

    layer_counts = [int(n) for n in args.layers.split(",")]
    names = args.passes.split(",")
    peaks: dict[str, dict[int, float]] = {name: {} for name in names}
    for layers in layer_counts:
        folder = args.work / f"layers{layers}"
        build_slice(folder, layers, args)
        for name in names:
            out = args.work / f"{name}-{layers}.npy"
            result = run_pass(name, folder / PASSES[name][2], out)
            if "error" in result:
                print(f"{name} at {layers} layers failed: {result['error']}")
                continue
            peaks[name][layers] = result["peak"]
            same = ""
            if args.save_logprobs is not None:
                args.save_logprobs.mkdir(parents=True, exist_ok=True)
                np.save(args.save_logprobs / out.name, np.load(out))
            if args.compare is not None and (args.compare / out.name).exists():
                known = np.load(args.compare / out.name)
                now = np.load(out)
                same = " log-probs " + (
                    "bit-identical" if np.array_equal(known.view(np.uint32), now.view(np.uint32)) else "DIFFER"
                )
            print(f"{name} at {layers} layers: peak {result['peak'] / GB:.2f} GB{same}", flush=True)
    first, last = layer_counts[0], layer_counts[-1]
    slope = {n: (p[last] - p[first]) / (last - first) for n, p in peaks.items() if first in p and last in p}
    slope = slope if last != first else {}  # one layer count: no growth to give
    print(f"\n| pass | {' | '.join(f'{n} layer(s), GB' for n in layer_counts)} | per added layer, GB | x bf16 |")
    print(f"|---|{'---|' * len(layer_counts)}---|---|")
    for name in names:
        cells = " | ".join(f"{peaks[name][n] / GB:.2f}" if n in peaks[name] else "-" for n in layer_counts)
        growth = slope.get(name)
        ratio = growth / slope["bf16"] if growth is not None and slope.get("bf16") else None
        print(
            f"| {name} | {cells} | {'-' if growth is None else f'{growth / GB:.3f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} |"
        )


if __name__ == "__main__":
    main()
