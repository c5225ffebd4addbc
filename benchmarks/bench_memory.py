"""Peak memory of every pass on slices of real configs' shapes, its growth per layer, and what that means for the
full models on GPUs of 80 GB.

    .venv/bin/python benchmarks/bench_memory.py --out DIR [--models qwen3-30b-a3b,qwen3-8b] [--layers 1,2,4]
        [--passes generate,matched,fp32,fp8,fp8-act,sweep,locate,diagnose] [--experts 128] [--vocab 151936]
        [--prompts 4] [--new-tokens 16] [--json FILE]

Slices: `qwen3-30b-a3b` is Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of 768, top 8, 32 query and 4
key-value heads of 128, vocabulary 151,936), `qwen3-8b` Qwen3-8B's (hidden 4096, intermediate 12288, 32 query
and 8 key-value heads of 128, vocabulary 151,936); each with 1, 2 or 4 layers (`--layers`), random bf16 weights
(seed 0) saved with save_pretrained, the demo model's tokenizer (its ids are below any vocabulary here).
`--experts` and `--vocab` narrow a slice to fit a small machine (the table says which slice it measured).

Each pass runs as its own `probe` process; its peak is that process's maximum resident memory (os.wait4's
rusage, what GNU time reports). The passes: `generate` (hf bf16, PROMPTS prompts x NEW_TOKENS tokens: the run
the others read), `matched` (rescore bf16), `fp32` (rescore --dtype fp32), `fp8` (rescore bf16
weight_quant=fp8-block128), `fp8-act` (and act_quant=fp8-token128), `sweep` (lm_head_dtype=fp32, and
router_dtype=fp32 on an MoE), `locate --b hf:fp32`, and `diagnose` on a copy of the rollout (every pass it plans).

Per pass: the slope of peak memory per added layer (least squares over the layer counts), its ratio to the
matched pass's slope, and the extrapolation to the full model: the slope's bytes per bf16 byte of a layer
times the full model's bf16 weights (its parameters counted on the meta device from the real config), plus
the runtime (the fit's intercept less the slice's embeddings and LM head at that rate): the CPU's resident
figure, which counts the checkpoint's pages read while loading too. The GPU view is the ratio to matched times
the full model's bf16 weights (on a GPU the matched pass holds them once); "fits" compares it with one GPU of
80 GB and with 8 (device_map spreading the layers evenly; no margin for activations or the KV cache). Full
models: 48 layers for Qwen3-30B-A3B and 94 for Qwen3-235B-A22B (its own shapes) from the 30B-A3B slice, 36 for
Qwen3-8B.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "mismatch_probe" / "data" / "models" / "moe"
PROMPTS = REPO / "mismatch_probe" / "data" / "prompts" / "demo.jsonl"
GB = 1e9
GPU_BYTES = 80 * GB
PASSES = ("generate", "matched", "fp32", "fp8", "fp8-act", "sweep", "locate", "diagnose")
FP8 = ["--engine-arg", "weight_quant=fp8-block128"]
MOE_30B = dict(
    model_type="qwen3_moe",
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
)
MOE_235B = MOE_30B | dict(hidden_size=4096, num_attention_heads=64, moe_intermediate_size=1536, intermediate_size=12288)
DENSE_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
)
# slice -> the full models it extrapolates to: (name, shapes, layers)
MODELS = {
    "qwen3-30b-a3b": (MOE_30B, [("Qwen3-30B-A3B", MOE_30B, 48), ("Qwen3-235B-A22B", MOE_235B, 94)]),
    "qwen3-8b": (DENSE_8B, [("Qwen3-8B", DENSE_8B, 36)]),
}


def _config(shapes: dict, layers: int):
    from transformers import AutoConfig

    kwargs = {k: v for k, v in shapes.items() if k != "model_type"}
    common = dict(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False)
    common |= dict(initializer_range=0.02, eos_token_id=0, pad_token_id=0)
    return AutoConfig.for_model(shapes["model_type"], **kwargs, **common)


def parameters(shapes: dict, layers: int) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(shapes, layers))
    return sum(p.numel() for p in model.parameters())


def build(shapes: dict, layers: int, out: Path) -> None:
    """Run in a child: random bf16 weights (seed 0), saved with the demo model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(_config(shapes, layers))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO / name).is_file():
            shutil.copy(DEMO / name, out / name)


def peak_of(command: list[str], log: Path) -> tuple[int, int]:
    """(exit code, maximum resident bytes) of `command` run as its own process."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        _, status, usage = os.wait4(process.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024


def pass_commands(name: str, model: Path, run: Path, is_moe: bool, args) -> list[list[str]]:
    probe = [sys.executable, "-m", "mismatch_probe"]
    if name == "generate":
        sample = ["--num-prompts", str(args.prompts), "--max-new-tokens", str(args.new_tokens), "--seed", "1"]
        return [[*probe, "generate", "--model", str(model), "--prompts", str(PROMPTS), "--out", str(run), *sample]]
    rescore = [*probe, "rescore", str(run), "--engine", "hf", "--overwrite"]
    if name == "matched":
        return [[*rescore, "--dtype", "bf16"]]
    if name == "fp32":
        return [[*rescore, "--dtype", "fp32"]]
    if name == "fp8":
        return [[*rescore, "--dtype", "bf16", *FP8, "--name", "fp8"]]
    if name == "fp8-act":
        return [[*rescore, "--dtype", "bf16", *FP8, "--engine-arg", "act_quant=fp8-token128", "--name", "fp8-act"]]
    if name == "sweep":
        knobs = ["--vary", "lm_head_dtype=fp32"] + (["--vary", "router_dtype=fp32"] if is_moe else [])
        return [[*probe, "sweep", str(run), "--engine", "hf", "--dtype", "bf16", "--overwrite", *knobs]]
    if name == "locate":
        return [[*probe, "locate", str(run), "--b", "hf:fp32", "--worst", "2", "--samples", "2"]]
    if name == "diagnose":  # a fresh copy of the rollout: every pass of the plan runs
        copy = run.parent / "diagnose-run"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        shutil.copy(run / "manifest.json", copy / "manifest.json")
        shutil.copytree(run / "rollout", copy / "rollout")
        return [[*probe, "diagnose", str(copy)]]
    raise SystemExit(f"--passes: unknown pass {name!r} (one of {', '.join(PASSES)})")


def slope(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least squares: (bytes per layer, intercept) over (layers, peak bytes); None under two layer counts."""
    if len({n for n, _ in points}) < 2:
        return None
    mean_x = sum(n for n, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    per = sum((n - mean_x) * (y - mean_y) for n, y in points) / sum((n - mean_x) ** 2 for n, _ in points)
    return per, mean_y - per * mean_x


def measure(args) -> dict:
    results: dict = {"slices": {}, "passes": list(args.passes)}
    for name in args.models:
        shapes = dict(MODELS[name][0])
        shapes["vocab_size"] = args.vocab or shapes["vocab_size"]
        if "num_experts" in shapes and args.experts:
            shapes["num_experts"] = max(args.experts, shapes["num_experts_per_tok"])
        entry = results["slices"][name] = {"shapes": shapes, "layers": {}}
        for layers in args.layers:
            folder = args.out / f"{name}-{layers}"
            model, run = folder / "model", folder / "run"
            if not (model / "config.json").is_file():
                build_command = [sys.executable, __file__, "--build", json.dumps(shapes), str(layers), str(model)]
                subprocess.run(build_command, check=True)
            peaks = entry["layers"][str(layers)] = {"parameters": parameters(shapes, layers)}
            for pass_name in args.passes:
                if pass_name == "generate":
                    shutil.rmtree(run, ignore_errors=True)
                for command in pass_commands(pass_name, model, run, "num_experts" in shapes, args):
                    code, peak = peak_of(command, folder / f"{pass_name}.log")
                    peaks[pass_name] = peak if code == 0 else None
                    shown = (
                        f"{peak / GB:.2f} GB" if code == 0 else f"failed (exit {code}, see {folder}/{pass_name}.log)"
                    )
                    print(f"{name} {layers} layer(s) {pass_name}: {shown}", flush=True)
                if pass_name == "generate" and peaks["generate"] is None:
                    break  # no run for the other passes to read
    return results


def _fits(peak: float) -> str:
    return "1 GPU" if peak <= GPU_BYTES else "8 GPUs" if peak <= 8 * GPU_BYTES else "no"


def table(results: dict) -> str:
    """Per slice: each pass's peaks, its slope per layer and ratio to matched's, and per full model the
    extrapolated CPU peak (RSS), the GPU view (x matched times the bf16 weights) and where that fits."""
    lines = []
    for name, entry in results["slices"].items():
        shapes, per_layers = entry["shapes"], entry["layers"]
        counts = sorted(int(n) for n in per_layers)
        fulls = [(full, parameters(full_shapes, n) * 2, n) for full, full_shapes, n in MODELS[name][1]]
        narrowed = {k: shapes[k] for k in ("num_experts", "vocab_size") if k in shapes}
        lines += [f"{name} slice ({', '.join(f'{k} {v}' for k, v in narrowed.items())}), peak RSS in GB:", ""]
        head = ["pass", *(f"{n} layer(s)" for n in counts), "per layer", "x matched"]
        head += [f"{full} ({n} layers): RSS / GPU view, fits" for full, _, n in fulls]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        params = {n: per_layers[str(n)]["parameters"] for n in counts}
        layer_bf16 = (params[counts[-1]] - params[counts[0]]) * 2 / max(counts[-1] - counts[0], 1)
        matched = slope([(n, per_layers[str(n)]["matched"]) for n in counts if per_layers[str(n)].get("matched")])
        for pass_name in results["passes"]:
            points = [(n, per_layers[str(n)][pass_name]) for n in counts if per_layers[str(n)].get(pass_name)]
            row = [pass_name] + [f"{y / GB:.2f}" if (y := per_layers[str(n)].get(pass_name)) else "-" for n in counts]
            fitted = slope(points)
            if fitted is None or not layer_bf16 or matched is None:
                lines.append("| " + " | ".join(row + ["-"] * (len(head) - len(row))) + " |")
                continue
            per, intercept = fitted
            ratio = per / matched[0]
            rate = per / layer_bf16  # bytes of peak per bf16 byte of a layer's weights
            non_layer_bf16 = params[counts[0]] * 2 - counts[0] * layer_bf16  # embeddings, LM head, final norm
            runtime = max(intercept - rate * non_layer_bf16, 0)  # Python, torch, the run's batches
            row += [f"{per / GB:.2f}", f"{ratio:.2f}"]
            for _, full_bf16, _ in fulls:
                rss, gpu = rate * full_bf16 + runtime, ratio * full_bf16
                row.append(f"{rss / GB:,.0f} / {gpu / GB:,.0f}, {_fits(gpu)}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--build":
        build(json.loads(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="slices, runs and logs go here")
    parser.add_argument("--models", default="qwen3-30b-a3b,qwen3-8b", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--layers", default="1,2,4")
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--experts", type=int, default=0, help="fewer experts per MoE layer (0: the config's)")
    parser.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (0: the config's)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.layers = [int(n) for n in args.layers.split(",") if n]
    args.passes = [p for p in args.passes.split(",") if p]
    for name in args.models:
        if name not in MODELS:
            raise SystemExit(f"--models: unknown slice {name!r} (one of {', '.join(MODELS)})")
    if "generate" not in args.passes:
        args.passes.insert(0, "generate")  # the run every other pass reads
    args.out.mkdir(parents=True, exist_ok=True)
    results = measure(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
