"""Out of memory (issue 56): a subprocess's address space is limited (RLIMIT_AS) so that the fp32 load of a test model
cannot fit, or so that a later, longer part's batch cannot; each is one stderr line naming what would fit, exit 1,
no folder left by a failed load, and a failed batch's parts kept with a manifest that says where it stopped, which
`--resume` continues to the set an uninterrupted run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.memory import (
    MemoryContext,
    OutOfMemory,
    batch_line,
    checkpoint_parameters,
    is_out_of_memory,
    loading,
    loading_line,
)

VOCAB = 32000
# The batch test's rescore: eager attention materialises each micro-batch's scores, sequences x heads x width^2
EAGER = ("--engine", "hf", "--dtype", "bf16", "--batch-size", 8, "--engine-arg", "attn_implementation=eager")
# The child: everything a rescore imports and touches first, then the limit: the address space it has then plus
# HEADROOM bytes, set at once ("now") or once the engine has loaded ("loaded": a loader's threads reserve address
# space unevenly, so a limit meant for a batch is set after it); then `probe ARGS...`. One malloc arena and one
# thread, so that the limit measures allocations rather than reservations.
CHILD = """
import resource, sys
import pyarrow.parquet, torch, transformers
from mismatch_probe.cli import app
import mismatch_probe.pipeline.rescore as rescore, mismatch_probe.engines.hf.training
HEADROOM, WHEN, MODEL = int(sys.argv[1]), sys.argv[2], sys.argv[3]

def limit():
    size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))

def loaded(*args, _load=rescore.training_engine, **kwargs):
    engine = _load(*args, **kwargs)
    limit()
    return engine

torch.ones(4) @ torch.ones(4)
# transformers reads its modeling source once per class (a heuristic of from_pretrained): read here, unlimited, so
# that a tight limit fails on the weights, not on a source file (an OSError "could not get source code" then)
with torch.device("meta"):
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(MODEL))
if WHEN == "now":
    limit()
else:
    rescore.training_engine = loaded
sys.argv = ["probe", *sys.argv[4:]]
app()
"""


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def limited(headroom: int, when: str, run: Path, *args) -> subprocess.CompletedProcess:
    """`probe rescore RUN ARGS...` in a child limited as CHILD says."""
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-c", CHILD, str(headroom), when, str(run.parent / "model"), "rescore", str(run)]
    command += [str(a) for a in args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A bf16 checkpoint of 38M parameters (a 32,000-token vocabulary) and its rollout in two parts: 8 samples of
    4-token prompts, then 8 of 2,000-token prompts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("oom")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, intermediate_size=1536, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "model")
    prompts = root / "prompts.jsonl"
    lengths = [4] * 8 + [2000] * 8
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": [(7 * i + j) % 900 + 2 for j in range(n)]}) + "\n" for i, n in enumerate(lengths)
        )
    )
    out = root / "run"
    result = probe(
        "generate", "--model", root / "model", "--prompts", prompts, "--out", out, "--engine", "hf",
        "--dtype", "bf16", "--batch-size", 8, "--max-new-tokens", 4,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(list((out / "rollout").glob("part-*.parquet"))) == 2
    return out


@pytest.mark.slow  # subprocesses under an address-space limit
def test_a_load_that_cannot_fit_is_one_line_and_leaves_no_folder(run):
    params = checkpoint_parameters(run.parent / "model")
    assert 35e6 < params < 40e6  # counted from the safetensors header
    before = sorted(p.name for p in (run / "scores").iterdir()) if (run / "scores").is_dir() else []
    # room for 1.5 times the bf16 weights beside what the child holds, not for the fp32 load's twice them
    result = limited(params * 3, "now", run, "--engine", "hf", "--dtype", "fp32", "--name", "oom")
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith("error: rescore oom on cpu: out of memory loading ")
    assert f"({params / 1e9:.2f}B parameters in fp32)" in line and "the device had" in line
    assert "--engine-arg device_map=auto" in line and "lm_head_dtype=fp32 or router_dtype=fp32" in line
    after = sorted(p.name for p in (run / "scores").iterdir()) if (run / "scores").is_dir() else []
    assert after == before  # no score-set folder, and nothing else touched


@pytest.mark.slow  # subprocesses under an address-space limit
def test_a_batch_that_cannot_fit_keeps_its_parts_and_resume_completes_the_set(run):
    # 600 MB beside the loaded model: the short part's eager attention (8 x 8 heads x 12 x 12 scores) fits, the long
    # part's (8 x 8 heads x 2004 x 2004 scores: 0.5 GB in bf16, 1 GB as float32 softmax) does not
    result = limited(600_000_000, "loaded", run, *EAGER, "--name", "cut")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    first, second = sorted(p.name for p in (run / "rollout").glob("part-*.parquet"))
    assert (
        f"out of memory in {run / 'rollout' / second}, a batch of 8 sequences (16032 tokens, the longest 2004"
        in errors[0]
    )
    assert "a smaller --batch-size (now 8) or --engine-arg logprob_chunk=N" in errors[0] and "--resume" in errors[0]
    manifest = json.loads((run / "scores" / "cut" / "manifest.json").read_text())
    assert manifest["status"] == "running"  # unfinished: readers refuse it, --resume continues it
    assert manifest["incomplete"]["stopped_at"] == second
    assert (manifest["incomplete"]["parts_done"], manifest["incomplete"]["parts"]) == (1, 2)
    assert [p.name for p in (run / "scores" / "cut").glob("part-*.parquet")] == [first]
    # the limit lifted: --resume completes the set, equal to an uninterrupted run's (each in a child of the same
    # environment: one thread, one arena, and no limit to speak of)
    assert limited(10**13, "now", run, *EAGER, "--name", "cut", "--resume").returncode == 0
    assert limited(10**13, "now", run, *EAGER, "--name", "whole").returncode == 0
    resumed = json.loads((run / "scores" / "cut" / "manifest.json").read_text())
    assert resumed["status"] == "complete" and resumed.get("incomplete") is None
    for part in (first, second):
        assert pq.read_table(run / "scores" / "cut" / part).equals(pq.read_table(run / "scores" / "whole" / part))


def test_the_allocators_errors_are_out_of_memory():
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried to allocate 14000000000 bytes. Error code 12"
        )
    )
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("size mismatch for lm_head.weight"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the allocators' own types


def test_lines_name_the_options_for_each_engine_and_stage(tmp_path):
    ctx = MemoryContext(command="rescore megatron-fp32", engine="megatron", dtype="fp32", device="cuda:0",
                        model=tmp_path, vocab_size=1000, batch_size=16)  # fmt: skip
    line = loading_line(ctx)
    assert "tensor_parallel=N or expert_parallel=N under torchrun" in line and "device_map" not in line
    assert "needs about unknown" in line  # no safetensors here: no estimate, said so
    generate = MemoryContext(command="generate", engine="hf", dtype="bf16", device="cpu", model=tmp_path,
                             vocab_size=1000, batch_size=64)  # fmt: skip
    text = batch_line(generate, "samples 64-127", (64, 10_000, 200), "64 of 256 samples are kept", chunk=False)
    # no config.json here: no heads or hidden size, so the estimate is the logits' alone (256 x 1000 x 8 bytes)
    assert "about 0.0 GB for its attention scores" in text and "a smaller --batch-size (now 64), then --resume" in text
    assert "logprob_chunk" not in text and "lm_head_dtype" not in loading_line(generate)
    with pytest.raises(OutOfMemory, match=r"^generate on cpu: out of memory loading"), loading(generate):
        raise MemoryError()
    with pytest.raises(KeyError), loading(generate):  # anything else passes through as it is
        raise KeyError("x")


def test_diagnose_marks_an_out_of_memory_pass_failed_with_its_line():
    from mismatch_probe.pipeline.diagnose.run import _why

    assert _why(OutOfMemory("rescore hf-fp32 on cpu: out of memory loading M: ...")).startswith(
        "rescore hf-fp32 on cpu"
    )
    why = _why(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert why.startswith("out of memory (DefaultCPUAllocator: can't allocate memory") and "--batch-size" in why
    assert _why(ValueError("bad")) == "ValueError: bad"
