"""miles `--dump-details DIR`: the train data under DIR/train_data/{rollout_id}_{rank}.pt.

Source read: radixark/miles,
- miles/utils/arguments.py (~line 3183): --dump-details sets save_debug_rollout_data to
  DIR/rollout_data/{rollout_id}.pt and save_debug_train_data to DIR/train_data/{rollout_id}_{rank}.pt.
- miles/utils/train_dump_utils.py (`save_debug_train_data_for_rank`, ~line 24): torch.save of
  {"rollout_id", "rank", "rollout_data", "cp_rank", "cp_size", "qkv_format"}, where rollout_data is the
  rank's train batch as columns (lists, one entry per sample): `tokens`, `response_lengths`, `loss_masks`,
  `rollout_log_probs`, `rollout_routed_experts` and the actor's `log_probs`, named as in slime (miles is
  slime's descendant; the per-sample reading is slime's, see slime.py).
The rollout_data/ files hold no training log-probs (written before training) and are not read. A rank's
file under context parallelism (cp_size > 1) holds a slice of each sequence and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, torch_load
from mismatch_probe.importers.slime import LACKS, sample
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.logged import LoggedSample, Provenance

# the columns slime.sample reads: each must hold one entry per sample
READ = ("tokens", "response_lengths", "loss_masks", "rollout_log_probs", "log_probs", "rollout_routed_experts")


def read(path: Path, trust_pickle: bool = False) -> Dump:
    root = path / "train_data" if (path / "train_data").is_dir() else path
    files = dump_files(root, "*.pt", "miles --dump-details train data (train_data/{rollout_id}_{rank}.pt)")
    provenance = Provenance(source_format="miles", source=str(path), training_engine="miles actor", lacks=LACKS)
    return Dump(provenance=provenance, samples=_samples(files, trust_pickle))


def _samples(files: list[Path], trust_pickle: bool) -> Iterator[LoggedSample]:
    for path in files:
        payload = torch_load(path, trust_pickle)
        data = payload.get("rollout_data") if isinstance(payload, dict) else None
        if not isinstance(data, dict):
            raise ProbeError(f"{path}: no 'rollout_data' dict (expected a miles train-data dump)")
        cp_size = payload.get("cp_size")
        if cp_size is not None and checked.count(cp_size, str(path), "cp_size") > 1:
            raise ProbeError(
                f"{path}: cp_size {payload['cp_size']}: each sequence is split across ranks; cannot import"
            )
        if "response_lengths" not in data:
            raise ProbeError(f"{path}: rollout_data has no 'response_lengths' (expected a miles train batch)")
        count = len(checked.numbers(data["response_lengths"], f"{path}: rollout_data", "response_lengths"))
        for key in READ:
            if key in data and not _per_sample(data[key], count):
                raise ProbeError(
                    f"{path}: rollout_data '{key}' is not a list of {count} entries (one per sample, as "
                    "'response_lengths')"
                )
        for i in range(count):
            row = {key: values[i] for key, values in data.items() if _per_sample(values, count)}
            yield sample(row, f"{path}: sample {i}", payload.get("rollout_id"), path)


def _per_sample(values, count: int) -> bool:
    return (
        isinstance(values, (list, tuple))
        and len(values) == count
        or (hasattr(values, "shape") and len(values.shape) >= 1 and values.shape[0] == count)
    )
