"""slime debug dumps: `--save-debug-train-data` (both sides) and `--save-debug-rollout-data` (inference only).

Source read: THUDM/slime,
- slime/observability/rollout_data_utils.py (`save_debug_rollout_data`, ~line 140): torch.save of
  {"rollout_id", "samples": [Sample.to_dict()]}; a Sample (slime/utils/types.py, ~line 105) holds `tokens`
  (prompt + response), `response_length`, `rollout_log_probs` and `rollout_routed_experts`
  [len(tokens) - 1, layers, top_k], but no training log-probs: the dump is written before training.
- slime/observability/train_data_utils.py (`_build_dump_payload`, ~line 110, `save_debug_train_data`,
  ~line 191): torch.save of {"format_version": 2, "samples": [...]}, one dict per sample holding the
  train batch's columns (slime/ray/rollout.py `_convert_samples_to_train_data`, ~line 657): `tokens`,
  `response_lengths`, `loss_masks`, `rollout_log_probs`, `rollout_routed_experts` and the actor's
  `log_probs` (slime/backends/megatron_utils/actor.py, ~line 521, captures them for the dump).
The train dump is the one to import; a rollout dump is refused with a line saying what it lacks.
Routing row p is the routing of position p. No model, engine, dtype or temperature is in either dump.
A torch dump is one pickle: each file is loaded whole (memory-mapped), one file at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, engines_not_in, field, step_in_name, torch_load
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.logged import LoggedSample, Provenance

WHAT = "a slime train-data sample (--save-debug-train-data)"
LACKS = engines_not_in("dump")
TRAIN_DATA = "train_data"  # beside rollout_data/ in a --dump-details folder


def read(path: Path, trust_pickle: bool = False) -> Dump:
    if path.is_dir() and (path / TRAIN_DATA).is_dir():  # `--dump-details DIR`: only train_data has both sides
        path = path / TRAIN_DATA
    files = dump_files(path, "*.pt", "slime debug dumps ({rollout_id}.pt)")
    provenance = Provenance(source_format="slime", source=str(path), training_engine="slime actor", lacks=LACKS)
    return Dump(provenance=provenance, samples=_samples(files, trust_pickle))


def _samples(files: list[Path], trust_pickle: bool) -> Iterator[LoggedSample]:
    for path in files:
        payload = torch_load(path, trust_pickle)
        samples = payload.get("samples") if isinstance(payload, dict) else None
        if not isinstance(samples, list):
            raise ProbeError(f"{path}: no 'samples' list (expected a slime debug dump)")
        step = payload.get("rollout_id")
        if step is None:  # a train dump written without it: the file is {rollout_id}.pt
            step = step_in_name(path)
        for i, obj in enumerate(samples):
            yield sample(obj, f"{path}: samples[{i}]", step, path)


def sample(obj: dict, where: str, step, path: Path) -> LoggedSample:
    """One sample of a train batch, as a dict of the batch's columns (slime and miles share the names)."""
    if not isinstance(obj, dict):
        raise ProbeError(f"{where}: is of type {type(obj).__name__}, expected a dict of the sample's fields ({WHAT})")
    if "log_probs" not in obj and "response_length" in obj:
        raise ProbeError(
            f"{path}: a rollout dump (--save-debug-rollout-data) holds no training log-probs ('log_probs'): "
            "the rollout-vs-training comparison cannot be made; import the --save-debug-train-data dump of this rollout"
        )
    tokens = checked.ids(field(obj, "tokens", where, WHAT), where, "tokens")
    response_length = checked.count(field(obj, "response_lengths", where, WHAT), where, "response_lengths")
    if not 0 < response_length <= len(tokens):
        raise ProbeError(f"{where}: response_lengths {response_length} does not fit the {len(tokens)} tokens")
    start = len(tokens) - response_length
    response = {
        "rollout_log_probs": checked.logprobs(
            field(obj, "rollout_log_probs", where, "the inference engine's log-probs"), where, "rollout_log_probs"
        ),
        "log_probs": checked.logprobs(field(obj, "log_probs", where, "the actor's log-probs"), where, "log_probs"),
    }
    if obj.get("loss_masks") is not None:
        response["loss_masks"] = checked.flags(obj["loss_masks"], where, "loss_masks")
    checked.lengths_agree(where, response, response_length, "response token")
    routed = obj.get("rollout_routed_experts")
    return LoggedSample(
        prompt_ids=tokens[:start],
        response_ids=tokens[start:],
        inference_logprobs=response["rollout_log_probs"],
        training_logprobs=response["log_probs"],
        routed_experts=None
        if routed is None
        else checked.ids(routed, where, "rollout_routed_experts", ndim=3, what="expert id"),
        response_mask=response.get("loss_masks"),
        step=step,
        where=where,
    )
