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

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, dump_sampling, engines_not_in, reason, step_in_name
from mismatch_probe.importers.safe_pickle import DumpUnpickler, torch_load_bytes
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.logged import LoggedSample, Provenance

REQUIRED = {
    "prompts": "the prompt ids",
    "responses": "the response ids",
    "attention_mask": "which positions are tokens, not padding",
    "rollout_log_probs": "the inference engine's log-probs (rollout.calculate_log_probs)",
    "old_log_probs": "the actor's log-probs",
}


def read(path: Path, trust_pickle: bool = False) -> Dump:
    files = dump_files(path, "*.pkl", "verl DataProto dumps (DataProto.save_to_disk)")
    provenance = Provenance(
        source_format="verl",
        source=str(path),
        training_engine="verl actor",
        lacks=engines_not_in("dump"),
    )
    return Dump(provenance=provenance, samples=_samples(files, provenance, trust_pickle))


def _samples(files: list[Path], provenance: Provenance, trust_pickle: bool) -> Iterator[LoggedSample]:
    for path in files:
        batch, meta = load_batch(path, trust_pickle)
        dump_sampling(provenance, meta, f"{path}: meta_info")
        yield from samples_of(batch, meta, path)


def samples_of(batch: dict[str, np.ndarray], meta: dict, path: Path) -> Iterator[LoggedSample]:
    for key, what in REQUIRED.items():
        if key not in batch:
            raise ProbeError(
                f"{path}: batch has no '{key}' ({what}); the rollout-vs-training comparison cannot be made"
            )
    _check_shapes(batch, path)
    prompts, responses, attention = batch["prompts"], batch["responses"], batch["attention_mask"]
    p_len = prompts.shape[1]
    mask = batch.get("response_mask")
    routed = batch.get("routed_experts")
    step = meta.get("global_steps")
    if step is None:  # a dump saved without meta_info's step: a per-step file name gives it
        step = step_in_name(path)
    for i in range(len(prompts)):
        where = f"{path}: sample {i}"
        keep = checked.flags(attention[i], where, "attention_mask")
        prompt_keep, response_keep = keep[:p_len], keep[p_len:]
        rows = (
            None if routed is None else checked.ids(routed[i][keep], where, "routed_experts", ndim=3, what="expert id")
        )
        yield LoggedSample(
            prompt_ids=checked.ids(prompts[i][prompt_keep], where, "prompts"),
            response_ids=checked.ids(responses[i][response_keep], where, "responses"),
            inference_logprobs=checked.logprobs(
                batch["rollout_log_probs"][i][response_keep], where, "rollout_log_probs"
            ),
            training_logprobs=checked.logprobs(batch["old_log_probs"][i][response_keep], where, "old_log_probs"),
            routed_experts=None if rows is None else routed_rows(rows),
            response_mask=None if mask is None else checked.flags(mask[i][response_keep], where, "response_mask"),
            step=step,
            where=where,
        )


def _check_shapes(batch: dict[str, np.ndarray], path: Path) -> None:
    """The batch's columns agree: [bsz, P] prompts, [bsz, R] responses and per-response-token columns,
    [bsz, P + R] attention_mask, [bsz, P + R, layers, top_k] routed_experts (agent_loop.py `_postprocess`)."""
    for key in ("prompts", "responses"):
        if batch[key].ndim != 2:
            raise ProbeError(f"{path}: '{key}' has shape {list(batch[key].shape)}, expected [batch size, tokens]")
    (bsz, p_len), r_len = batch["prompts"].shape, batch["responses"].shape[1]
    expected = {"responses": [bsz, r_len], "attention_mask": [bsz, p_len + r_len]}
    expected |= {key: [bsz, r_len] for key in ("rollout_log_probs", "old_log_probs", "response_mask")}
    for key, shape in expected.items():
        if key in batch and list(batch[key].shape) != shape:
            raise ProbeError(
                f"{path}: '{key}' has shape {list(batch[key].shape)}, expected {shape} "
                f"(prompts {list(batch['prompts'].shape)}, responses {list(batch['responses'].shape)})"
            )
    routed = batch.get("routed_experts")
    if routed is not None and (routed.ndim != 4 or list(routed.shape[:2]) != [bsz, p_len + r_len]):
        raise ProbeError(
            f"{path}: 'routed_experts' has shape {list(routed.shape)}, expected [{bsz}, {p_len + r_len}, layers, top_k]"
        )


def routed_rows(rows) -> np.ndarray:
    """verl zero-fills the positions the server returned no routing for (agent_loop.py ~599): the last one,
    never forwarded, at least. With top_k >= 2 a real row never repeats an expert, so trailing all-zero rows
    are that filling and are dropped; with top_k = 1 expert 0 is a real choice, so only the last row goes
    when it is zero (its routing is never returned)."""
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


def _consolidated(metadata: dict, storage, *args):
    """The consolidated TensorDict as {key: array}: each leaf is a byte range of one storage."""
    import torch

    data = storage.numpy() if hasattr(storage, "numpy") else np.asarray(storage)
    leaves = {}
    for key, (dtype, shape, start, _stop, *_) in metadata.get("leaves", {}).items():
        # torch's own namespace, never getattr: torch's module __getattr__ imports modules (torch._dynamo) and
        # calls deprecated attributes' replacements, chosen here by the dump's string
        dt = vars(torch).get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"leaf '{key}' has dtype {dtype!r}, not a torch dtype")
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize  # the range may end in alignment padding
        leaves[key] = torch.from_numpy(data[start : start + size].copy()).view(dt).reshape(shape)
    return leaves


def stand_in(module: str, name: str):
    """The globals verl's pickles name that probe reads without verl or tensordict (safe_pickle.py lists the
    rest): the DataProto, and the consolidated TensorDict's rebuild; any other TensorDict form is refused."""
    if (module, name) == ("verl.protocol", "DataProto"):
        return _DataProtoState
    if (module, name) == ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"):
        return _consolidated
    if module.startswith("tensordict"):
        raise ProbeError(
            f"the batch is a TensorDict saved as {module}.{name}, which probe reads only consolidated "
            "(tensordict >= 0.5)"
        )
    return None


def unpickle(fh, where, trust: bool = False):
    """verl's outer pickle (DataProto.save_to_disk) through the allowlist, verl's DataProto as its stand-in."""
    return DumpUnpickler(fh, where=where, trust=trust, extra=stand_in).load()


def load_batch(path: Path, trust_pickle: bool = False) -> tuple[dict[str, np.ndarray], dict]:
    """The batch's tensors as numpy arrays, and meta_info, from a DataProto.save_to_disk file."""
    import torch

    try:
        with open(path, "rb") as fh:
            proto = unpickle(fh, path, trust_pickle)
    except ProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is unusable input
        raise ProbeError(f"{path}: not a verl DataProto dump ({reason(exc)})") from exc
    if not isinstance(proto, _DataProtoState) or not isinstance(getattr(proto, "state", None), tuple):
        raise ProbeError(f"{path}: not a verl DataProto dump (expected a pickled verl.protocol.DataProto)")
    if len(proto.state) != 3:
        raise ProbeError(
            f"{path}: the DataProto's state has {len(proto.state)} entries, expected 3 (batch, non_tensor_batch, meta_info)"
        )
    batch_bytes, _non_tensor, meta = proto.state
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ProbeError(f"{path}: meta_info is a {type(meta).__name__}, expected a dict")
    if not isinstance(batch_bytes, bytes):
        raise ProbeError(f"{path}: the batch is not torch.save bytes (VERL_DATAPROTO_SERIALIZATION_METHOD=numpy?)")
    try:
        leaves = torch_load_bytes(batch_bytes, path, trust_pickle, stand_in)
    except ProbeError as exc:
        if str(exc).startswith(f"{path}: "):  # a refused global names the file already
            raise
        raise ProbeError(f"{path}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure to read the batch is unusable input
        raise ProbeError(f"{path}: cannot read the DataProto batch ({reason(exc)})") from exc
    if not isinstance(leaves, dict):
        raise ProbeError(f"{path}: the DataProto batch is not a TensorDict")
    arrays, numeric = {}, {torch.bool, torch.bfloat16, torch.float16, torch.float32, torch.float64}
    numeric |= {getattr(torch, f"{kind}{bits}", None) for kind in ("int", "uint") for bits in (8, 16, 32, 64)}
    for key, leaf in leaves.items():
        if not isinstance(leaf, torch.Tensor) or leaf.dtype not in numeric:
            raise ProbeError(
                f"{path}: batch '{key}' is {getattr(leaf, 'dtype', type(leaf).__name__)}, expected a tensor of numbers"
            )
        # numpy has no bfloat16: such a leaf (log-probs kept in bf16) is widened, exactly, to float32
        arrays[key] = (leaf.float() if leaf.dtype == torch.bfloat16 else leaf).numpy()
    return arrays, meta
