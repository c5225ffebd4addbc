"""Cost of leaving the Recorder on, and `probe import` throughput.

    .venv/bin/python benchmarks/bench_recorder.py [--tokens 2000000] [--seq 1024] [--routed] [--repeats 3]

Recorder: `add` of sequences of --seq tokens (1/8 prompt) from numpy arrays until --tokens tokens, then
close; the time per 1M tokens (seconds and µs per token) is what a training loop pays, compared with
nothing (the loop's own work is not measured). With --routed each sequence also carries routed experts
[tokens, 4 layers, top-2] (uint8 ids, as an MoE rollout returns them).
Import: a prime-rl token export, a NeMo-RL train-data file (JSON parsing included) and a slime train-data
dump (torch.save, one file) of the same tokens, imported as `probe import` does; tokens per second.
The median of --repeats is printed, and /proc/loadavg before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mismatch_probe.importers import DumpFormat
from mismatch_probe.importers.job import ImportJob, run_import
from mismatch_probe.record import Recorder


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[:3].__str__()


def record_once(out: Path, tokens: int, seq: int, routed: bool) -> float:
    rng = np.random.default_rng(0)
    prompt_len = seq // 8
    prompt = rng.integers(0, 150_000, prompt_len)
    response = rng.integers(0, 150_000, seq - prompt_len)
    lp = -rng.exponential(1.0, seq - prompt_len).astype(np.float32)
    lp2 = lp * np.float32(1.01)
    experts = rng.integers(0, 64, (seq - 1, 4, 2)).astype(np.uint8) if routed else None
    start = time.perf_counter()
    with Recorder(out, num_experts=64 if routed else None) as rec:
        for _ in range(tokens // seq):
            rec.add(prompt, response, lp, lp2, routed_experts=experts)
    return time.perf_counter() - start


def write_exports(root: Path, tokens: int, seq: int) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(1)
    prompt_len = seq // 8
    ids = rng.integers(0, 150_000, seq).tolist()
    lp = np.r_[np.zeros(prompt_len), -rng.exponential(1.0, seq - prompt_len)].round(6).tolist()
    mask = [False] * prompt_len + [True] * (seq - prompt_len)
    prime = root / "prime" / "token_exports" / "step_1" / "rank_0.jsonl"
    prime.parent.mkdir(parents=True)
    line = {"step": 1, "token_ids": ids, "position_ids": list(range(seq)), "loss_mask": mask}
    line |= {"inference_logprobs": lp, "trainer_logprobs": lp}
    prime.write_text((json.dumps(line, separators=(",", ":")) + "\n") * (tokens // seq))
    nemo = root / "nemo" / "train_data_step1.jsonl"
    nemo.parent.mkdir(parents=True)
    row = {"input_lengths": [seq], "token_ids": [ids], "token_loss_mask": [[int(m) for m in mask]]}
    row |= {"generation_logprobs": [lp], "prev_logprobs": [lp]}
    nemo.write_text((json.dumps(row) + "\n") * (tokens // seq))
    slime = root / "slime" / "3.pt"
    slime.parent.mkdir(parents=True)
    import torch

    lp_t, ids_t = torch.tensor(lp[prompt_len:], dtype=torch.float32), torch.tensor(ids)
    samples = [  # distinct objects: pickle would store a repeated one once
        {"tokens": ids_t.clone(), "response_lengths": seq - prompt_len, "rollout_log_probs": lp_t.clone()}
        | {"log_probs": lp_t.clone()}
        for _ in range(tokens // seq)
    ]
    torch.save({"format_version": 2, "rollout_id": 3, "samples": samples}, slime)
    return prime.parents[2], nemo.parent, slime.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--routed", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load before: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        times = []
        for i in range(args.repeats):
            times.append(record_once(tmp / f"rec{i}", args.tokens, args.seq, args.routed))
            shutil.rmtree(tmp / f"rec{i}")
        per_m = statistics.median(times) / (args.tokens / 1e6)
        kind = "with routed experts [4 x 2]" if args.routed else "log-probs only"
        print(f"Recorder ({kind}): {per_m:.3f} s per 1M tokens ({per_m:.3f} µs/token), median of {args.repeats}")
        prime, nemo, slime = write_exports(tmp, args.tokens, args.seq)
        for fmt, path in ((DumpFormat.prime_rl, prime), (DumpFormat.nemo_rl, nemo), (DumpFormat.slime, slime)):
            size = sum(p.stat().st_size for p in path.rglob("*.*")) / 1e6
            spent = []
            for i in range(args.repeats):
                start = time.perf_counter()
                result = run_import(ImportJob(format=fmt, path=path, out=tmp / f"imp-{fmt.value}-{i}"))
                spent.append(time.perf_counter() - start)
            rate = result.tokens / statistics.median(spent)
            print(f"import {fmt.value}: {rate / 1e6:.2f}M tokens/s ({size:.0f} MB dump, {result.tokens} tokens)")
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
