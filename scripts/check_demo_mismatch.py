"""Check that the demo models show the mismatch the demo is about.

Samples responses with HF `generate` (bf16, KV cache, temperature 1), rescores prompt+response with one full forward
in bf16 and in fp32, and prints per model: k3 = mean(r - 1 - log r), F(1.5) = share of tokens with max(r, 1/r) > 1.5,
and for the MoE model the share of (token, layer) router top-k sets that differ from generate's.

    .venv/bin/python scripts/check_demo_mismatch.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "mismatch_probe" / "data"


class RouterTap:
    """Collects the top-k expert ids every `mlp.gate` router returns (its third output)."""

    def __init__(self, model):
        self.calls: list[list[torch.Tensor]] = []
        self.gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer):
        def hook(_module, _inputs, output):
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].detach().sort(-1).values)

        return hook

    def take(self) -> list[torch.Tensor]:
        """One [rows, layers, k] tensor per forward call since the last take."""
        calls, self.calls = self.calls, []
        return [torch.stack(c, dim=1) for c in calls]


def load(path: Path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, (RouterTap(model) if getattr(model.config, "num_experts", 0) else None)


@torch.no_grad()
def check(path: Path, prompts: list[str], max_new: int, seed: int) -> dict:
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    batch, plen = enc["input_ids"].shape

    gen_model, gen_tap = load(path, torch.bfloat16)
    torch.manual_seed(seed)
    out = gen_model.generate(
        **enc,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seq = out.sequences
    new = seq[:, plen:]
    ref = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, new[..., None])[..., 0]

    ends = torch.isin(new, torch.tensor(gen_model.generation_config.eos_token_id).flatten())
    live = (ends.cumsum(1) - ends.long()) == 0  # response tokens up to and including the first end token
    attn = torch.cat([enc["attention_mask"], torch.ones_like(new)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)

    if gen_tap is not None:
        calls = gen_tap.take()
        k_layers = calls[0].shape[1:]
        decode = [c.view(batch, 1, *k_layers) for c in calls[1:]]
        gen_routes = torch.cat([calls[0].view(batch, plen, *k_layers), *decode], 1)
        # positions forwarded by generate: real prompt tokens and live response tokens but the last sampled one
        routed = torch.cat([enc["attention_mask"].bool(), live[:, :-1]], 1)[:, : gen_routes.shape[1]]

    result = {"tokens": int(live.sum())}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model, tap = load(path, dtype)
        logits = model(input_ids=seq, attention_mask=attn, position_ids=pos).logits.float()
        cand = torch.log_softmax(logits[:, plen - 1 : -1], -1).gather(-1, new[..., None])[..., 0]
        log_r = (cand - ref)[live]
        r = log_r.exp()
        result[f"k3_{name}"] = (r - 1 - log_r).mean().item()
        result[f"F1.5_{name}"] = (log_r.abs() > torch.log(torch.tensor(1.5))).float().mean().item()
        result[f"max_abs_log_r_{name}"] = log_r.abs().max().item()
        if tap is not None:
            full = tap.take()[0].view(batch, seq.shape[1], *k_layers)[:, : gen_routes.shape[1]]
            differs = (full != gen_routes).any(-1)  # [batch, positions, layers]
            result[f"router_diff_{name}"] = differs[routed].float().mean().item()
            result[f"router_diff_tokens_{name}"] = differs.any(-1)[routed].float().mean().item()
    return result


def record(args, results: dict, checks: dict) -> None:
    head = "## Mismatch check"
    text = args.record.read_text().split(head)[0].rstrip()
    keys = [k for k in results["moe"] if k != "tokens"]
    lines = [
        head,
        "",
        f"`scripts/check_demo_mismatch.py -n {args.n} --seed {args.seed}`: bf16 `generate` (KV cache, temperature 1) "
        "rescored by one full forward in bf16 and in fp32; router diff = share of (token, layer) top-k sets "
        "that differ, router_diff_tokens = share of tokens with any.",
        "",
        "| model | response tokens | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for name, res in results.items():
        cells = [f"{res[k]:.3g}" if k in res else "" for k in keys]
        lines.append(f"| {name} | {res['tokens']} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {'ok' if ok else 'FAILS'}: {what}" for what, ok in checks.items()]
    args.record.write_text(text + "\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", type=Path, default=[DATA / "models/moe", DATA / "models/dense"])
    ap.add_argument("--prompts", type=Path, default=DATA / "prompts/demo.jsonl")
    # 256 prompts give ~2000 response tokens; 32 give too few for the rare large routing-flip deviations
    ap.add_argument("-n", type=int, default=256, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", type=Path, default=None, help="append the figures to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lines = args.prompts.read_text().splitlines()[: args.n]
    prompts = [json.loads(line)["prompt"] for line in lines]
    results = {p.name: check(p, prompts, args.max_new_tokens, args.seed) for p in args.models}
    for name, res in results.items():
        print(name, " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    if {"moe", "dense"} <= results.keys():
        moe, dense = results["moe"], results["dense"]
        checks = {
            "moe k3 > dense k3 (bf16)": moe["k3_bf16"] > dense["k3_bf16"],
            "moe k3 > dense k3 (fp32)": moe["k3_fp32"] > dense["k3_fp32"],
            "moe F(1.5) > 0 (fp32)": moe["F1.5_fp32"] > 0,
            "moe router diff > 0": moe["router_diff_bf16"] > 0 and moe["router_diff_fp32"] > 0,
        }
        for what, ok in checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if args.record:
            record(args, results, checks)
        raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
