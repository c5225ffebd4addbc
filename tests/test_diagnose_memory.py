"""`probe diagnose` plans memory: each pass's estimated peak bytes (checked here against the formula computed by
hand from config.json and the safetensors headers), its measured peak once it ran, and a pass whose estimate
exceeds the device's free memory (planted smaller than the locate pass's estimate) skipped with why "memory" and
the option that lets it run, the diagnosis still completing. One configuration is loaded at a time: every
checkpoint load finds the models loaded before it freed."""

from __future__ import annotations

import json
import math
import shutil
import weakref
from pathlib import Path

import pytest
from safetensors import safe_open

from mismatch_probe.engines.hf import inference as hf_inference
from mismatch_probe.engines.hf import training as hf_training
from mismatch_probe.engines.peak import RSS_SINCE_START
from mismatch_probe.pipeline.diagnose import memory as diagnose_memory
from tests.conftest import DEMO_MOE, DEMO_PROMPTS
from tests.test_diagnose import SMALL, probe


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> Path:
    """A plain MoE rollout (no quantization, raw log-probs): matched, fp32, repeats, r3, sweep and locate apply."""
    run = tmp_path_factory.mktemp("diagnose-memory") / "run"
    assert probe("generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL).exit_code == 0
    return run


def plan_of(run: Path) -> dict:
    return {p["name"]: p for p in json.loads((run / "diagnose" / "plan.json").read_text())["passes"]}


def hand_estimate(run: Path, bytes_per_parameter: int, sequences: int = 8) -> int:
    """Weights plus one batch (engines/memory.py's formula, written out): scores, one logits chunk, hidden states."""
    config = json.loads((DEMO_MOE / "config.json").read_text())
    params = 0
    for path in DEMO_MOE.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    import pyarrow.parquet as pq

    parts = sorted((run / "rollout").glob("*.parquet"))
    tokens = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    samples = json.loads((run / "manifest.json").read_text())["num_samples"]
    width = math.ceil(tokens / samples)
    batch = sequences * config["num_attention_heads"] * width * width * 4
    batch += min(sequences * width, 256) * config["vocab_size"] * 8 + sequences * width * config["hidden_size"] * 32
    return params * bytes_per_parameter + batch


def test_dry_run_gives_each_pass_its_estimate(rollout, tmp_path):
    run = Path(shutil.copytree(rollout, tmp_path / "run"))
    result = probe("diagnose", run, "--dry-run")
    assert result.exit_code == 0, result.output
    plan = plan_of(run)
    assert plan["matched"]["memory"]["estimate_bytes"] == hand_estimate(run, 2)
    assert plan["fp32"]["memory"]["estimate_bytes"] == hand_estimate(run, 4)
    assert plan["repeats"]["memory"]["estimate_bytes"] == hand_estimate(run, 2)
    assert plan["locate"]["memory"]["estimate_bytes"] > hand_estimate(run, 4, sequences=4)
    for name in ("doctor", "report"):
        assert plan[name]["memory"]["estimate_bytes"] is None
    assert plan["matched"]["memory"]["free_bytes"] > 0 and plan["matched"]["memory"]["peak_bytes"] is None


def test_a_pass_over_the_free_memory_is_skipped_and_the_diagnosis_completes(tmp_path, monkeypatch):
    """The second form (generate first): the planted free memory holds the fp32 pass's estimate (computed by hand
    once the rollout exists) but not locate's; every model load, the rollout's included, finds the earlier ones
    gone without the test collecting anything (the diagnosis frees them itself)."""
    run = tmp_path / "run"
    free = []

    def planted(device: str) -> int:
        free[:] = free or [
            hand_estimate(run, 4, sequences=2)
        ]  # --batch-size 2; fp32's estimate exactly: fp32 fits, locate (larger) does not
        return free[0]

    monkeypatch.setattr(diagnose_memory, "available_bytes", planted)
    alive: list[weakref.ref] = []  # every model loaded so far
    at_load: list[int] = []

    def watching(original):
        def load(*args, **kwargs):
            at_load.append(sum(ref() is not None for ref in alive))
            model = original(*args, **kwargs)
            alive.append(weakref.ref(model))
            return model

        return load

    monkeypatch.setattr(hf_training, "load_hf_model", watching(hf_training.load_hf_model))
    monkeypatch.setattr(hf_inference, "load_hf_model", watching(hf_inference.load_hf_model))
    result = probe("diagnose", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, *SMALL)
    assert result.exit_code == 0, result.output
    assert at_load == [0, 0, 0]  # the rollout's model, matched's configuration, fp32's: each freed before the next
    plan = plan_of(run)
    locate = plan["locate"]
    assert (locate["status"], locate["why"]) == ("skipped", "memory")
    assert locate["memory"]["free_bytes"] == free[0] and locate["memory"]["estimate_bytes"] > free[0]
    assert plan["fp32"]["memory"]["estimate_bytes"] == free[0]
    assert locate["memory"]["to_fit"].startswith("probe locate by hand with device_map=auto")
    assert locate["command"] == f"probe locate {run} --b hf:fp32 --worst 4 --samples 2"
    assert "locate skipped: memory: about" in result.output and "to fit: probe locate by hand" in result.output
    for name in ("generate", "matched", "r3", "repeats", "sweep", "fp32", "doctor", "report"):
        assert plan[name]["status"] == "ran", name
        assert plan[name]["memory"]["peak_bytes"] > 0 and plan[name]["memory"]["peak_of"] == RSS_SINCE_START
    peaks = [p["memory"]["peak_bytes"] for p in plan.values() if p["status"] == "ran"]  # in the order they ran
    assert peaks == sorted(peaks)  # the process's peak so far: it only grows
    assert not (run / "locate").exists()


def test_to_fit_names_the_option_of_each_engine():
    hf = diagnose_memory.to_fit("hf", {}, "fp32")
    assert hf.startswith("--train-arg device_map=auto")
    assert diagnose_memory.to_fit("megatron", {}, "matched").startswith("--train-arg tensor_parallel=N or")
    assert diagnose_memory.to_fit("hf", {"device_map": "auto"}, "fp32").startswith("more memory")


@pytest.mark.parametrize(
    ("stored", "dtype", "engine", "quantized", "expected"),
    [
        ("bfloat16", "fp32", "hf", False, 2),  # kept as stored, a module at a time upcast (engines/hf/upcast.py)
        ("float32", "fp32", "hf", False, 4),
        ("bfloat16", "fp32-bf16w", "hf", False, 2),
        ("float32", "fp32-bf16w", "hf", False, 2),  # loads bf16, rounding the weights
        ("bfloat16", "fp32", "megatron", False, 4),  # megatron builds its model at the pass's dtype
        ("bfloat16", "fp32", "hf", True, 4),  # an fp32 quantized pass loads fp32
        ("bfloat16", "bf16", "hf", True, 2),  # codes: at most the dtype's bytes
        ("float32", "bf16", "hf", False, 2),
    ],
)
def test_held_bytes_follow_what_each_pass_keeps(tmp_path, stored, dtype, engine, quantized, expected):
    import torch
    from safetensors.torch import save_file

    from mismatch_probe.engines.memory import held_bytes

    save_file({"a.weight": torch.zeros(4, 4, dtype=getattr(torch, stored))}, str(tmp_path / "model.safetensors"))
    assert held_bytes(tmp_path, dtype, engine=engine, quantized=quantized) == expected
