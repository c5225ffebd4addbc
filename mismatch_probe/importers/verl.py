"""verl DataProto dumps (`DataProto.save_to_disk`), one per step: the batch after the actor recomputed log-probs.

Source read: volcengine/verl,
- verl/protocol.py (`save_to_disk`, ~line 437; `__getstate__`/`__setstate__`, ~line 388): a pickle of the
  DataProto whose state is (torch.save bytes of the TensorDict batch, non_tensor_batch, meta_info).
  tensordict >= 0.5 saves the batch consolidated: one uint8 storage and, per key, (dtype, shape, start,
  stop) offsets into it.
- verl/experimental/agent_loop/agent_loop.py (`_postprocess`, ~line 735): `prompts` [bsz, P] left-padded,
  `responses` [bsz, R] right-padded, `response_mask`, `attention_mask` [bsz, P + R], `rollout_log_probs`
  [bsz, R] (the inference engine's), and with R3 on `routed_experts` [bsz, P + R, layers, top_k] aligned
  with input_ids (~line 590).
- verl/trainer/ppo/ray_trainer.py (~line 93): `old_log_probs` [bsz, R], the actor's recomputed log-probs; the
  trainer's batch carries `meta_info["temperature"]` (actor_rollout_ref.rollout.temperature, set where the
  batch is built), the temperature of both the rollout and the actor's log-probs.
The dump is read without verl or tensordict installed (the DataProto and the consolidated TensorDict are
rebuilt from their saved state). No model, engine or dtype is in the batch; the temperature (and a top_p or
top_k) where meta_info holds them.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, dump_sampling, engines_not_in, step_in_name
from mismatch_probe.rundir.logged import LoggedSample, Provenance, as_array

REQUIRED = {
    "prompts": "the prompt ids",
    "responses": "the response ids",
    "attention_mask": "which positions are tokens, not padding",
    "rollout_log_probs": "the inference engine's log-probs (rollout.calculate_log_probs)",
    "old_log_probs": "the actor's log-probs",
}


def read(path: Path) -> Dump:
    files = dump_files(path, "*.pkl", "verl DataProto dumps (DataProto.save_to_disk)")
    provenance = Provenance(
        source_format="verl",
        source=str(path),
        training_engine="verl actor",
        lacks=engines_not_in("dump"),
    )
    return Dump(provenance=provenance, samples=_samples(files, provenance))


def _samples(files: list[Path], provenance: Provenance) -> Iterator[LoggedSample]:
    for path in files:
        batch, meta = load_batch(path)
        dump_sampling(provenance, meta if isinstance(meta, dict) else {}, f"{path}: meta_info")
        yield from samples_of(batch, meta, path)


def samples_of(batch: dict[str, np.ndarray], meta: dict, path: Path) -> Iterator[LoggedSample]:
    for key, what in REQUIRED.items():
        if key not in batch:
            raise ProbeError(
                f"{path}: batch has no '{key}' ({what}); the rollout-vs-training comparison cannot be made"
            )
    prompts, responses, attention = batch["prompts"], batch["responses"], batch["attention_mask"].astype(bool)
    p_len = prompts.shape[1]
    if attention.shape[1] != p_len + responses.shape[1]:
        raise ProbeError(f"{path}: attention_mask has {attention.shape[1]} columns, expected prompts + responses")
    mask = batch.get("response_mask")
    routed = batch.get("routed_experts")
    step = meta.get("global_steps") if isinstance(meta, dict) else None
    if step is None:  # a dump saved without meta_info's step: a per-step file name gives it
        step = step_in_name(path)
    for i in range(len(prompts)):
        keep = attention[i]
        prompt_keep, response_keep = keep[:p_len], keep[p_len:]
        yield LoggedSample(
            prompt_ids=prompts[i][prompt_keep],
            response_ids=responses[i][response_keep],
            inference_logprobs=batch["rollout_log_probs"][i][response_keep],
            training_logprobs=batch["old_log_probs"][i][response_keep],
            routed_experts=None if routed is None else routed_rows(routed[i][keep]),
            response_mask=None if mask is None else mask[i][response_keep].astype(bool),
            step=None if step is None else int(step),
            where=f"{path}: sample {i}",
        )


def routed_rows(rows) -> np.ndarray:
    """verl zero-fills the positions the server returned no routing for (agent_loop.py ~599): the last one,
    never forwarded, at least. With top_k >= 2 a real row never repeats an expert, so trailing all-zero rows
    are that filling and are dropped; with top_k = 1 expert 0 is a real choice, so only the last row goes
    when it is zero (its routing is never returned)."""
    rows = as_array(rows, np.int64)
    if rows.ndim != 3 or not len(rows):
        return rows
    filled = (rows != 0).any(axis=(1, 2))
    if rows.shape[2] == 1:
        return rows[:-1] if not filled[-1] else rows
    return rows[: int(np.flatnonzero(filled)[-1]) + 1] if filled.any() else rows[:0]


class _DataProtoState:
    """Stands in for verl.protocol.DataProto while unpickling: keeps the state verl saved."""

    def __setstate__(self, state):
        self.state = state


class _DumpUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "verl.protocol" and name == "DataProto":
            return _DataProtoState
        return super().find_class(module, name)


def _consolidated(metadata: dict, storage, *args):
    """The consolidated TensorDict as {key: array}: each leaf is a byte range of one storage."""
    import torch

    data = storage.numpy() if hasattr(storage, "numpy") else np.asarray(storage)
    leaves = {}
    for key, (dtype, shape, start, _stop, *_) in metadata.get("leaves", {}).items():
        dt = getattr(torch, dtype.removeprefix("torch."))
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize  # the range may end in alignment padding
        leaves[key] = torch.from_numpy(data[start : start + size].copy()).view(dt).reshape(shape)
    return leaves


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "tensordict._reductions" and name == "_rebuild_tensordict_files_consolidated":
            return _consolidated
        if module.startswith("tensordict"):
            raise ProbeError(
                f"the batch is a TensorDict saved as {module}.{name}, which probe reads only consolidated "
                "(tensordict >= 0.5)"
            )
        return super().find_class(module, name)


_PICKLE = types.ModuleType("probe_verl_pickle")  # torch.load takes the Unpickler from a pickle module
_PICKLE.Unpickler = _BatchUnpickler
_PICKLE.load = pickle.load
_PICKLE.__dict__["__name__"] = "pickle"


def load_batch(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The batch's tensors as numpy arrays, and meta_info, from a DataProto.save_to_disk file."""
    import torch

    try:
        with open(path, "rb") as fh:
            proto = _DumpUnpickler(fh).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ModuleNotFoundError) as exc:
        raise ProbeError(f"{path}: not a verl DataProto dump ({type(exc).__name__}: {exc})") from exc
    if not isinstance(proto, _DataProtoState) or not isinstance(getattr(proto, "state", None), tuple):
        raise ProbeError(f"{path}: not a verl DataProto dump (expected a pickled verl.protocol.DataProto)")
    batch_bytes, _non_tensor, meta = proto.state
    if not isinstance(batch_bytes, bytes):
        raise ProbeError(f"{path}: the batch is not torch.save bytes (VERL_DATAPROTO_SERIALIZATION_METHOD=numpy?)")
    try:
        leaves = torch.load(io.BytesIO(batch_bytes), map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except ProbeError as exc:
        raise ProbeError(f"{path}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure to read the batch is unusable input
        raise ProbeError(f"{path}: cannot read the DataProto batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(leaves, dict):
        raise ProbeError(f"{path}: the DataProto batch is not a TensorDict")
    # numpy has no bfloat16: such a leaf (log-probs kept in bf16) is widened, exactly, to float32
    arrays = {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in leaves.items()}
    return arrays, meta or {}
