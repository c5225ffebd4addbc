"""Framework dumps for the importer tests, each written the way its framework's writer writes it.

The field names, nesting and alignment follow the sources cited in each importer module
(mismatch_probe/importers/*.py); the verl fixture is written by verl itself (scripts/make_verl_fixture.py).
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

LAYERS, TOP_K, EXPERTS = 2, 2, 8


@dataclass
class Seq:
    prompt: np.ndarray
    response: np.ndarray
    inference: np.ndarray  # per response token
    training: np.ndarray
    mask: np.ndarray  # loss mask over the response
    experts: np.ndarray  # [len(prompt) + len(response) - 1, LAYERS, TOP_K], as SGLang returns them


def make_seqs(
    n: int = 5,
    seed: int = 0,
    masked_token: bool = True,
    layers: int = LAYERS,
    experts: int = EXPERTS,
    vocab: int = 1000,
) -> list[Seq]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        p, r = int(rng.integers(2, 6)), int(rng.integers(1, 8))
        inference = -rng.exponential(1.0, r)
        training = np.minimum(inference + rng.normal(0, 0.1, r), 0)
        mask = np.ones(r, dtype=bool)
        if masked_token and i == 1 and r > 2:
            mask[r // 2] = False  # a tool-output token inside the response: no log-prob
        length = p + r - 1
        routed = np.argsort(rng.random((length, layers, experts)), axis=-1)[..., :TOP_K]
        seqs.append(
            Seq(
                prompt=rng.integers(0, vocab, p),
                response=rng.integers(0, vocab, r),
                inference=inference.astype(np.float32),
                training=training.astype(np.float32),
                mask=mask,
                experts=routed,
            )
        )
    return seqs


def k3_of(seqs: list[Seq]) -> float:
    """The known answer: mean over loss-masked response tokens of r - 1 - log r, log r = training - inference."""
    d = np.concatenate([(s.training.astype(np.float64) - s.inference)[s.mask] for s in seqs])
    return float(np.mean(np.exp(d) - 1 - d))


# ---- slime and miles (torch.save of the train batch's columns) --------------------------------


def _train_columns(seqs: list[Seq], routed: bool) -> dict[str, list]:
    columns = {
        "tokens": [np.concatenate([s.prompt, s.response]).tolist() for s in seqs],
        "response_lengths": [len(s.response) for s in seqs],
        "loss_masks": [s.mask.astype(int).tolist() for s in seqs],
        "rollout_log_probs": [s.inference.tolist() for s in seqs],
        "log_probs": [torch.from_numpy(s.training) for s in seqs],
        "sample_indices": list(range(len(seqs))),
    }
    if routed:
        columns["rollout_routed_experts"] = [torch.from_numpy(s.experts.astype(np.int32)) for s in seqs]
    return columns


def write_slime_train(path: Path, seqs: list[Seq], routed: bool = True, rollout_id: int | None = 3) -> Path:
    columns = _train_columns(seqs, routed)
    samples = [{"data_parallel_rank": 0, **{k: v[i] for k, v in columns.items()}} for i in range(len(seqs))]
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": samples, "dp_shards": []}
    if rollout_id is None:
        del payload["rollout_id"]
    torch.save(payload, path)
    return path


def write_verl_step(source: Path, path: Path, step: int, meta_info: dict | None = None) -> Path:
    """verl's own DataProto dump (the fixture) saved again with meta_info's global_steps = step (and the other
    meta_info entries given, e.g. the trainer's temperature), as DataProto.save_to_disk pickles it: the class
    verl.protocol.DataProto and its state tuple."""
    from mismatch_probe.importers.verl import unpickle

    with open(source, "rb") as fh:
        batch, non_tensor, meta = unpickle(fh, source).state
    return write_verl_state(path, (batch, non_tensor, {**meta, "global_steps": step, **(meta_info or {})}))


def _as_global(module_name: str, name: str, obj):
    """`obj` named module_name.name, as the pickler looks it up (the real module need not be installed)."""
    module = types.ModuleType(module_name)
    setattr(module, name, obj)
    obj.__module__, obj.__qualname__ = module_name, name
    return module


def _pickled_with(modules: dict[str, types.ModuleType], dump) -> None:
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        dump()
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def write_verl_state(path: Path, state: tuple) -> Path:
    """A DataProto.save_to_disk file (verl/protocol.py `save_to_disk`, `__getstate__`): a pickle of the class
    verl.protocol.DataProto with state (batch bytes, non_tensor_batch, meta_info)."""

    class DataProto:
        def __init__(self, state):
            self.state = state

        def __getstate__(self):
            return self.state

    modules = {"verl": types.ModuleType("verl"), "verl.protocol": _as_global("verl.protocol", "DataProto", DataProto)}
    path.parent.mkdir(parents=True, exist_ok=True)
    _pickled_with(modules, lambda: path.write_bytes(pickle.dumps(DataProto(state))))
    return path


def consolidated_batch(arrays: dict[str, np.ndarray]) -> bytes:
    """torch.save bytes of a TensorDict as tensordict >= 0.5 consolidates it (what verl's fixture holds: the
    global tensordict._reductions._rebuild_tensordict_files_consolidated called with the metadata, per leaf
    (dtype, shape, start, stop, pad) into one uint8 storage, and that storage)."""
    leaves, chunks, start = {}, [], 0
    for key, array in arrays.items():
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        pad = -len(data) % 8
        leaves[key] = (str(tensor.dtype), list(tensor.shape), start, start + len(data), pad)
        chunks.append(data + bytes(pad))
        start += len(data) + pad
    storage = torch.frombuffer(bytearray(b"".join(chunks) or bytes(8)), dtype=torch.uint8)
    metadata = {"cls": "TensorDict", "non_tensors": {}, "leaves": leaves, "cls_metadata": {"batch_size": [3]}}

    def _rebuild_tensordict_files_consolidated(*args):
        raise AssertionError("only pickled")

    class Batch:
        def __reduce__(self):
            return (_rebuild_tensordict_files_consolidated, (metadata, storage))

    name = "_rebuild_tensordict_files_consolidated"
    modules = {
        "tensordict": types.ModuleType("tensordict"),
        "tensordict._reductions": _as_global("tensordict._reductions", name, _rebuild_tensordict_files_consolidated),
    }
    buffer = io.BytesIO()
    _pickled_with(modules, lambda: torch.save(Batch(), buffer))
    return buffer.getvalue()


def write_slime_rollout(path: Path, seqs: list[Seq]) -> Path:
    samples = [
        {
            "index": i,
            "tokens": np.concatenate([s.prompt, s.response]).tolist(),
            "response_length": len(s.response),
            "rollout_log_probs": s.inference.tolist(),
            "rollout_routed_experts": s.experts.tolist(),
            "status": "completed",
        }
        for i, s in enumerate(seqs)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": 3, "samples": samples}, path)
    return path


def write_miles(root: Path, seqs: list[Seq], routed: bool = True, cp_size: int = 1) -> Path:
    path = root / "train_data" / "1_0.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _train_columns(seqs, routed)
    torch.save(dict(rollout_id=1, rank=0, rollout_data=data, cp_rank=0, cp_size=cp_size, qkv_format="thd"), path)
    return root


# ---- prime-rl (token_exports/step_N/rank_R.jsonl) ---------------------------------------------


def write_prime_rl(root: Path, seqs: list[Seq], step: int = 1) -> Path:
    path = root / "token_exports" / f"step_{step}" / "rank_0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for i, s in enumerate(seqs):
            n, p = len(s.prompt) + len(s.response), len(s.prompt)
            mask = np.r_[np.zeros(p, dtype=bool), s.mask]
            inference = np.r_[np.zeros(p), s.inference].tolist()
            trainer = np.r_[-np.ones(p), s.training].tolist()
            record = {
                "schema_version": 1,
                "step": step,
                "rank": 0,
                "micro_step": 0,
                "micro_sequence_idx": i,
                "export_sequence_idx": i,
                "env_name": "math",
                "token_ids": np.concatenate([s.prompt, s.response]).tolist(),
                "position_ids": list(range(n)),
                "loss_mask": mask.tolist(),
                "advantages": [0.5] * n,
                "inference_logprobs": inference,
                "trainer_logprobs": trainer,
                "entropy": [1.0] * n,
                "mismatch_kl": [None] * n,
            }
            fh.write(json.dumps(record, separators=(",", ":")) + "\n")
    return root


# ---- NeMo-RL (train_data_step{N}.jsonl, one sample per line, each field a batch of one) --------


def _padded(values, width: int) -> list:
    return np.r_[values, np.zeros(width - len(values))].tolist()


def write_nemo_rl(root: Path, seqs: list[Seq], step: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    width = max(len(s.prompt) + len(s.response) for s in seqs)  # the batch is padded to its longest sample
    with open(root / f"train_data_step{step}.jsonl", "w") as f:
        for i, s in enumerate(seqs):
            p, n = len(s.prompt), len(s.prompt) + len(s.response)
            tokens = np.concatenate([s.prompt, s.response])
            sample = {
                "content": [["user text", "assistant text"]],
                "rewards": [1.0],
                "input_lengths": [n],
                "token_ids": [[int(t) for t in tokens] + [0] * (width - n)],
                "token_loss_mask": [_padded(np.r_[np.zeros(p), s.mask.astype(float)], width)],
                "sample_loss_mask": [1.0],
                "advantages": [_padded(np.zeros(n), width)],
                "generation_logprobs": [_padded(np.r_[np.zeros(p), np.where(s.mask, s.inference, 0)], width)],
                "prev_logprobs": [_padded(np.r_[np.zeros(p), s.training], width)],
            }
            f.write(json.dumps({**sample, "idx": i}) + "\n")
    return root
