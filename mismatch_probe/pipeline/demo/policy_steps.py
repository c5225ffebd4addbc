"""New-policy checkpoints θ_new: a few policy-gradient steps on a run's own rollout.

Each step is one Adam step on the whole rollout (gradients accumulated over micro-batches) of the
truncated-IS loss in policy_loss.py, with rewards from rewards.py and group-mean advantages.
Every step reuses the same rollout, so later checkpoints are staler against it, as off-policy
mini-batches are. The demo makes its θ_new this way; users bring their own checkpoints.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from mismatch_probe.engines.hf.model import load_hf_model
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import write_json_atomic
from mismatch_probe.model.hf_config import load_hf_config
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.pipeline.demo.policy_batch import PolicyBatch, read_policy_batch
from mismatch_probe.pipeline.demo.policy_loss import micro_batches, tis_loss, token_logprobs
from mismatch_probe.pipeline.demo.rewards import reward
from mismatch_probe.progress import console, progress_bar
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.ownership import Entry, Layout, clear, json_with, named_files, refuse_foreign
from mismatch_probe.rundir.parts import require_parts
from mismatch_probe.vocab import FP32

POLICY_STEP_FILE = "policy_step.json"
# The source's files that are not weights or config, copied as they are so each checkpoint loads alone.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
CHECKPOINT_LAYOUT = Layout(
    what="a probe policy-step checkpoint",
    entries=(
        Entry(pattern=POLICY_STEP_FILE, check=json_with("step", "lr", "tis_cap", "source_model")),
        *named_files("config.json", "model*.safetensors", "model.safetensors.index.json", f".{POLICY_STEP_FILE}.tmp"),
        *named_files(*SIDE_FILES),
    ),
    marker=POLICY_STEP_FILE,
)
CHECKPOINTS_LAYOUT = Layout(
    what="a folder of probe policy-step checkpoints", entries=(Entry(pattern="step-*", layout=CHECKPOINT_LAYOUT),)
)


def make_policy_checkpoints(
    run: Path,
    model: Path,
    out: Path,
    steps: tuple[int, ...] = (1, 2, 4, 8),
    lr: float = 1e-4,
    tis_cap: float = 5.0,
    seed: int = 0,
) -> dict[int, Path]:
    """Save the model after each of `steps` policy-gradient steps on `run`'s rollout as `out/step-N/`."""
    steps = _checked(steps, lr, tis_cap)
    rollout = Run(run)
    manifest = rollout.manifest()
    manifest.check_finished(rollout.manifest_path)
    manifest.check_scoring_temperature(rollout.manifest_path)
    require_parts(rollout.rollout_dir)
    if not manifest.routing.is_moe:
        raise ProbeError(f"{run}: the rollout's model is dense; policy-step checkpoints are made for MoE routing")
    info = load_model_info(model)
    manifest.check_model(info)  # the steps start from the rollout's own checkpoint
    refuse_foreign(out, CHECKPOINTS_LAYOUT)  # before any work, and before anything is replaced
    torch.manual_seed(seed)
    hf = load_hf_model(info, FP32)
    hf.requires_grad_(True)
    pad = hf.generation_config.pad_token_id
    pad_id = int(pad) if pad is not None else 0
    temperature = float(manifest.scoring_temperature)
    batch = read_policy_batch(rollout.rollout_dir, manifest.routing, _tokenizer(model), reward)
    optimizer = torch.optim.Adam(hf.parameters(), lr=lr)
    chosen = batch.with_signal()
    if not chosen:
        console.print(f"{run}: every advantage is 0 (no prompt's samples differ in reward): the steps change nothing")
    facts = {
        "source_model": str(info.path),
        "rollout": str(Path(run).resolve()),
        "lr": lr,
        "tis_cap": tis_cap,
        "seed": seed,
        "optimizer": "Adam, one step per full-batch pass over the rollout",
        "loss": "-mean over response tokens of min(exp(l - mu), tis_cap) * A * l, A = r - mean over the prompt's samples",
        "reward": f"{reward.__module__}.{reward.__qualname__}",  # the function itself names it: a move keeps it true
        "temperature": temperature,
        "samples": len(batch.requests),
        "samples_with_signal": len(chosen),
        "loss_tokens": batch.loss_tokens,
        "mean_reward": float(batch.rewards.mean()),
    }
    saved = {}
    with progress_bar() as bar:
        task = bar.add_task("policy steps", total=max(steps, default=0), unit="steps")
        for step in range(1, max(steps, default=0) + 1):
            optimizer.zero_grad(set_to_none=False)
            _accumulate(hf, batch, chosen, temperature, tis_cap, pad_id)
            optimizer.step()
            if step in steps:
                saved[step] = _save(hf, model, out / f"step-{step}", facts | {"step": step})
            bar.advance(task)
    return saved


def _tokenizer(model: Path):
    """The source's tokenizer: it decodes the stored ids for the rewards (nothing is re-tokenized)."""
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise ProbeError(f"{model}: cannot load tokenizer ({str(exc).splitlines()[0]})") from exc


def _checked(steps: tuple[int, ...], lr: float, tis_cap: float) -> tuple[int, ...]:
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
        raise ProbeError(f"steps {tuple(steps)}: expected positive whole numbers")
    if not lr >= 0:
        raise ProbeError(f"lr {lr!r}: expected a number >= 0")
    if not tis_cap > 0:
        raise ProbeError(f"tis_cap {tis_cap!r}: expected a number > 0")
    return tuple(sorted(set(steps)))


def _accumulate(hf, batch: PolicyBatch, chosen: list[int], temperature: float, tis_cap: float, pad_id: int) -> None:
    """Gradients of the whole batch's loss; samples with a zero advantage add exactly 0, so only `chosen` run."""
    requests = [batch.requests[i] for i in chosen]
    for indices in micro_batches(requests):
        picked = [chosen[i] for i in indices]
        logprob = token_logprobs(hf, [batch.requests[i] for i in picked], temperature, pad_id)
        behaviour = [batch.behaviour[i] for i in picked]
        advantage = np.repeat(batch.advantages[picked], [len(mu) for mu in behaviour])
        tis_loss(logprob, np.concatenate(behaviour), advantage, tis_cap, batch.loss_tokens).backward()


def _save(hf, source: Path, target: Path, facts: dict) -> Path:
    """A loadable checkpoint in the source's own dtype, with its tokenizer and generation config."""
    if target.exists():
        clear(target, CHECKPOINT_LAYOUT)
    target.mkdir(parents=True, exist_ok=True)
    # The source's own dtype: loading in fp32 rewrote the loaded config's.
    dtype = getattr(load_hf_config(source, False), "dtype", None) or torch.float32
    saved = hf if dtype == torch.float32 else copy.deepcopy(hf).to(dtype)
    saved.save_pretrained(target)
    for name in SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, target / name)
    write_json_atomic(target / POLICY_STEP_FILE, facts)
    return target
