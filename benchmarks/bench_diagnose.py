"""`probe diagnose` against the same passes run by hand, one plan command after another: checkpoint loads and time.

    .venv/bin/python benchmarks/bench_diagnose.py [--model DIR] [--num-prompts 16] [--max-new-tokens 16] [--plain]

Both start from one rollout of the MoE demo model (by default with fp8 weights and top-p 0.7 processed log-probs,
so that every pass applies; --plain: a plain bf16 rollout). `diagnose` runs on one copy; on the other, every
command its plan.json names is run as given (the commands are what a person would type). Loads are counted at
the hf training engine's model loader, as benchmarks/bench_sweep.py counts them (locate's two hooked models
included on both sides).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from bench_sweep import DATA, CountedLoads
from typer.testing import CliRunner

from mismatch_probe.cli import app

PRODUCTION = ["--engine-arg", "weight_quant=fp8-block128", "--top-p", "0.7", "--logprobs-mode", "processed"]


def probe(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    if result.exit_code not in (0, 1):  # 1: doctor findings, or locate's bitwise agreement
        raise SystemExit(f"probe {' '.join(args)}: exit {result.exit_code}\n{result.output[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DATA / "models" / "moe")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="A plain bf16 rollout (no quant, no truncation).")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-diagnose-"))
    try:
        run = work / "run"
        sampling = [] if args.plain else PRODUCTION
        probe(
            *("generate", "--model", str(args.model), "--prompts", str(DATA / "prompts" / "demo.jsonl")),
            *("--out", str(run), "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)),
            *sampling,
        )
        by_hand = work / "by-hand"
        shutil.copytree(run, by_hand)
        loads = CountedLoads()
        started = time.perf_counter()
        probe("diagnose", str(run))
        diagnosed = (loads.count, loads.seconds, time.perf_counter() - started)
        plan = json.loads((run / "diagnose" / "plan.json").read_text())
        commands = [p["command"] for p in plan["passes"] if p["status"] == "ran"]
        loads.count, loads.seconds, started = 0, 0.0, time.perf_counter()
        for command in commands:
            probe(*shlex.split(command.replace(str(run), str(by_hand)))[1:])
        separate = (loads.count, loads.seconds, time.perf_counter() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nmodel {args.model.name}, {args.num_prompts} prompts, {args.max_new_tokens} new tokens, {plan['tokens']} positions"
    )
    print(f"passes run: {', '.join(p['name'] for p in plan['passes'] if p['status'] == 'ran')}")
    print(f"{'':28}{'checkpoint loads':>18}{'s in loads':>12}{'wall s':>10}")
    for what, (count, in_loads, wall) in (
        ("probe diagnose", diagnosed),
        (f"{len(commands)} commands by hand", separate),
    ):
        print(f"{what:28}{count:>18}{in_loads:>12.2f}{wall:>10.2f}")


if __name__ == "__main__":
    main()
