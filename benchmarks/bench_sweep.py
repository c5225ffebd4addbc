"""`probe sweep` of 4 training variants against 4 separate `probe rescore` runs: checkpoint loads and wall time.

    .venv/bin/python benchmarks/bench_sweep.py [--model DIR] [--num-prompts 16] [--max-new-tokens 32]

Both score the same 4 variants of a bf16 base on the same rollout, whose base score set is made first (untimed,
so both start from it). Loads are counted at the hf training engine's model loader. The variants are the hf
engine's remedy knobs where it has them (lm_head_dtype, router_dtype, attn_implementation), else LM-head chunk
sizes; a sweep loads once where the engine switches them on a loaded model (TrainingEngine.reconfigure), and
once per variant where it cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.hf import training as hf_training
from mismatch_probe.engines.options import build_options
from mismatch_probe.pipeline.generate import GenerateJob, run_generate
from mismatch_probe.pipeline.rescore import RescoreJob, run_rescore
from mismatch_probe.pipeline.sweep.plan import SweepJob
from mismatch_probe.pipeline.sweep.run import run_sweep

DATA = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data"
REMEDY_KNOBS = (("lm_head_dtype", "fp32"), ("router_dtype", "fp32"), ("attn_implementation", "eager"))


class CountedLoads:
    """Calls of the hf training engine's model loader, and the seconds spent in them."""

    def __init__(self):
        self.count, self.seconds, self.original = 0, 0.0, hf_training.load_hf_model

        def counted(*args, **kwargs):
            self.count, started = self.count + 1, time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        hf_training.load_hf_model = counted


def switch_logprob_chunk(self, engine_args: dict) -> bool:
    new = build_options(self.Options, self.name, engine_args)
    if any(
        getattr(new, f.name) != getattr(self.options, f.name)
        for f in dataclasses.fields(new)
        if f.name != "logprob_chunk"
    ):
        return False
    self.options = new
    return True


def variants(chunks_only: bool) -> list[tuple[str, str]]:
    fields = {f.name for f in dataclasses.fields(hf_training.HFTrainingEngine.Options)}
    if not chunks_only and all(key in fields for key, _ in REMEDY_KNOBS):
        return [*REMEDY_KNOBS, ("logprob_chunk", "64")]
    return [("logprob_chunk", str(n)) for n in (32, 64, 128, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DATA / "models" / "moe")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--switch-logprob-chunk",
        action="store_true",
        help="Where the hf engine's own reconfigure switches nothing yet: give it one that switches logprob_chunk "
        "(read at every score call, so switching it in place is exact) and sweep chunk sizes.",
    )
    args = parser.parse_args()
    if args.switch_logprob_chunk:
        hf_training.HFTrainingEngine.reconfigure = switch_logprob_chunk

    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        run = work / "base-run"
        run_generate(
            GenerateJob(
                model=args.model,
                prompts=DATA / "prompts" / "demo.jsonl",
                out=run,
                engine="hf",
                params=SamplingParams(max_new_tokens=args.max_new_tokens, seed=1),
                config=EngineConfig(dtype="bf16", batch_size=16),
                samples_per_prompt=2,
                num_prompts=args.num_prompts,
            )
        )
        base = EngineConfig(dtype="bf16", batch_size=8)
        run_rescore(RescoreJob(run=run, engine="hf", config=base))  # the base set both start from
        swept, separate = work / "swept", work / "separate"
        shutil.copytree(run, swept)
        shutil.copytree(run, separate)
        knobs = variants(args.switch_logprob_chunk)
        loads = CountedLoads()

        started = time.perf_counter()
        run_sweep(SweepJob(run=swept, engine="hf", config=base, vary=tuple(f"{k}={v}" for k, v in knobs)))
        sweep = (loads.count, loads.seconds, time.perf_counter() - started)

        loads.count, loads.seconds, started = 0, 0.0, time.perf_counter()
        for key, value in knobs:
            config = dataclasses.replace(base, engine_args={key: value})
            run_rescore(RescoreJob(run=separate, engine="hf", config=config, name=f"hf-bf16+{key}-{value}"))
        separate = (loads.count, loads.seconds, time.perf_counter() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    print(f"\nmodel {args.model.name}, {args.num_prompts} prompts x 2 samples, {device}")
    print(f"variants: {', '.join(f'{k}={v}' for k, v in knobs)}")
    switching = "switches logprob_chunk (--switch-logprob-chunk)" if args.switch_logprob_chunk else "the engine's own"
    print(f"reconfigure: {switching}")
    print(f"{'':20}{'checkpoint loads':>18}{'s in loads':>12}{'wall s':>10}")
    for what, (count, in_loads, wall) in (("probe sweep", sweep), ("4 x probe rescore", separate)):
        print(f"{what:20}{count:>18}{in_loads:>12.2f}{wall:>10.2f}")


if __name__ == "__main__":
    main()
