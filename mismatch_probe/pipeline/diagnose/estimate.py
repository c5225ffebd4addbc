"""What each pass will cost, and the order passes run in.

Before the first pass, a pass's seconds come from the model's size and the run's tokens: a forward costs about
2 x parameters FLOPs per token, at a rough rate for the device, and a checkpoint load reads its weight files at
a rough disk rate. Once the matched pass has run, its measured tokens per second and load time replace both.
Each pass costs a multiple of one forward over the run (`FORWARDS`), and the pass that first needs a checkpoint
pays its load.

Order: the matched pass first (every share pairs against it, and it measures the speed); then the passes that
share its loaded checkpoint, then each other checkpoint's passes together (one load per configuration), each
block and each pass within one by value per estimated second (passes.VALUE); the doctor and the report last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.pipeline.diagnose.passes import (
    DOCTOR,
    END,
    FP32,
    GENERATE,
    LOCATE,
    MATCHED,
    PLANNED,
    QUANT,
    R3_PASS,
    REPEATS,
    REPORT,
    SAMPLING,
    SWEEP,
    Pass,
)

CPU_FLOPS, GPU_FLOPS = 2e10, 2e14  # sustained FLOP/s of a forward, roughly, before anything is measured
LOAD_BYTES_PER_S, LOAD_FIXED_S = 5e8, 2.0
READ_TOKENS_PER_S = 2e5  # doctor and report: a streaming pass over the run's Parquet, per side
REPORT_S_PER_SET = 1.0  # and, per comparison, its finishing, figures and card
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# Forwards over the run's tokens a pass costs, as multiples of the matched pass's: fp32 computes at twice the
# bytes, repeats are two passes, R3 and truncated sampling add a little per token, fake quantization more;
# generate samples token by token.
FORWARDS = {MATCHED: 1.0, FP32: 2.0, REPEATS: 2.0, R3_PASS: 1.1, QUANT: 1.5, SAMPLING: 1.2, GENERATE: 3.0}
LOCATE_FORWARDS = 6.0  # two hooked configurations, each about three forwards' worth with its captures


@dataclass
class Speed:
    tokens_per_second: float
    load_s: float
    measured: bool = False


def weight_bytes(model: str | Path | None) -> int:
    folder = Path(model) if model else None
    if folder is None or not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def prior_speed(model: str | Path | None) -> Speed:
    """From the checkpoint's size: parameters at the bytes per parameter its config stores them in."""
    size = weight_bytes(model)
    width = 2
    config = Path(model) / "config.json" if model else None
    if config is not None and config.is_file():
        stored = json.loads(config.read_text()).get("dtype") or json.loads(config.read_text()).get("torch_dtype")
        width = 4 if stored in ("float32", "fp32") else 2
    params = max(size / width, 1e6)
    flops = CPU_FLOPS
    try:
        import torch

        flops = GPU_FLOPS if torch.cuda.is_available() else CPU_FLOPS
    except ImportError:  # pragma: no cover - torch ships with every engine
        pass
    return Speed(tokens_per_second=flops / (2 * params), load_s=LOAD_FIXED_S + size / LOAD_BYTES_PER_S)


def estimate(passes: list[Pass], facts, speed: Speed, loaded: str | None, knobs: int, sweep_loads: int = 0) -> None:
    """Set every planned pass's estimate_s (and load_s), `loaded` the configuration whose checkpoint is in memory;
    `facts` the rollout's (job.RolloutFacts: its tokens and samples)."""
    tokens, samples = facts.tokens, facts.samples
    sets = sum(len(p.score_sets) for p in passes if p.status in (PLANNED, "ran", "reused"))
    groups_loaded = {loaded} if loaded else set()
    for p in order(passes):
        if p.status != PLANNED:
            continue
        forward = tokens / max(speed.tokens_per_second, 1e-9)
        if p.name == REPORT:  # every score set a comparison: its pass, its figures, its cards
            p.load_s, seconds = 0.0, 2.0 + max(sets, 1) * (REPORT_S_PER_SET + tokens / READ_TOKENS_PER_S)
        elif p.name in END:
            p.load_s, seconds = 0.0, 0.5 + max(sets, 1) * tokens / READ_TOKENS_PER_S
        elif p.name == LOCATE:
            share = min(1.0, 6 / max(samples, 1))
            p.load_s, seconds = 2 * speed.load_s, LOCATE_FORWARDS * share * forward
        elif p.name == SWEEP:  # sweep_loads: an engine that switches no knob in place loads once per variant
            p.load_s, seconds = sweep_loads * speed.load_s, 1.1 * max(knobs, 1) * forward
        else:
            p.load_s, seconds = 0.0, FORWARDS.get(p.name, 1.0) * forward
        if p.name == GENERATE:  # the inference engine's own load
            p.load_s += speed.load_s
        if p.group is not None and p.group not in groups_loaded:
            p.load_s += speed.load_s
            groups_loaded.add(p.group)
        p.estimate_s = seconds + p.load_s


def order(passes: list[Pass]) -> list[Pass]:
    """The order passes run in (module docstring); estimates may be None (then value alone orders)."""
    first = [p for p in passes if p.name in (GENERATE, MATCHED)]
    end = [p for p in passes if p.name in END]
    end.sort(key=lambda p: p.name != DOCTOR)
    rest = [p for p in passes if p not in first and p not in end]
    matched = next((p for p in passes if p.name == MATCHED), None)
    home = matched.group if matched else None
    blocks: dict[str, list[Pass]] = {}
    for p in rest:
        blocks.setdefault(p.group or p.name, []).append(p)

    def rate(items: list[Pass]) -> float:
        value = sum(p.value for p in items)
        seconds = sum(p.estimate_s or 1.0 for p in items)
        return value / max(seconds, 1e-9)

    for items in blocks.values():  # the sweep last: its variants leave the engine switched (or loaded) away
        items.sort(key=lambda p: (p.name == SWEEP, -rate([p])))
    ranked = sorted(blocks.items(), key=lambda kv: (kv[0] != home, -rate(kv[1])))
    return first + [p for _, items in ranked for p in items] + end


def checkpoint_notes(passes: list[Pass], engine_loads_per_sweep: int) -> int:
    """Write each pass's checkpoint note in run order and return the training-checkpoint loads planned."""
    first_of: dict[str, str] = {}
    loads = 0
    for p in order(passes):
        if p.status != PLANNED or p.group is None:
            p.checkpoint = "loads its own two hooked models" if p.name == LOCATE and p.status == PLANNED else ""
            continue
        if p.group in first_of:
            p.checkpoint = f"shares the {p.group} checkpoint loaded for {first_of[p.group]}"
        else:
            first_of[p.group] = p.name
            loads += 1
            p.checkpoint = f"loads the {p.group} checkpoint"
        if p.name == SWEEP and engine_loads_per_sweep:
            p.checkpoint += f" (and {engine_loads_per_sweep} more: the engine switches no knob in place)"
            loads += engine_loads_per_sweep
    return loads
