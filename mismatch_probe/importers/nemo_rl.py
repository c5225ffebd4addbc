"""NeMo-RL train data: the `train_data_step{N}.jsonl` files GRPO writes to its log directory.

Source read: NVIDIA-NeMo/RL, nemo_rl/algorithms/grpo.py (~line 3630, the "Log training data" block) and
nemo_rl/utils/logger.py (`log_batched_dict_as_jsonl`, ~line 1071). Each line is one sample, a batch of one,
so every field is wrapped in a one-element list: `token_ids` (padded to the batch's longest sample),
`input_lengths` (the real length), `token_loss_mask`, `generation_logprobs` (the inference engine's) and
`prev_logprobs` (the training policy's, before the update; grpo.py ~3239), aligned by index with the
tokens (nemo_rl/models/policy/workers/dtensor_policy_worker.py ~1281 prepends a 0), zero where the loss
mask is off. With `force_on_policy_ratio` NeMo-RL skips the policy pass and writes zeros instead
(grpo.py ~3247): such a sample has no training side and is refused. The prompt is the tokens before the first loss-masked one. The file carries no
routing, model, engine, dtype or temperature; the step is in the file name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, engines_not_in, field, jsonl_objects
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.logged import LoggedSample, Provenance

WHAT = "a NeMo-RL train_data_step*.jsonl line"
STEP = re.compile(r"train_data_step(\d+)\.jsonl$")


def read(path: Path, trust_pickle: bool = False) -> Dump:
    """`trust_pickle` is unused: JSONL holds no pickle."""
    files = dump_files(path, "train_data_step*.jsonl", "NeMo-RL train data (train_data_step*.jsonl)")
    provenance = Provenance(
        source_format="nemo-rl",
        source=str(path),
        training_engine="nemo-rl policy",
        lacks=engines_not_in("train data"),
    )
    return Dump(provenance=provenance, samples=_samples(sorted(files, key=_step)))


def _step(path: Path) -> tuple[int, str]:
    match = STEP.search(path.name)
    return (int(match.group(1)) if match else -1, path.name)


def _samples(files: list[Path]) -> Iterator[LoggedSample]:
    for path in files:
        step = _step(path)[0]
        for where, obj in jsonl_objects(path):
            yield sample(obj, where, None if step < 0 else step)


def _unwrap(value):
    """A batch of one: [[...]] -> [...], [n] -> n."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def sample(obj: dict, where: str, step: int | None) -> LoggedSample:
    # the row is padded to the batch's longest sample: only its first input_lengths values are read
    padded = checked.numbers(_unwrap(field(obj, "token_ids", where, WHAT)), where, "token_ids")
    length = checked.count(_unwrap(field(obj, "input_lengths", where, WHAT)), where, "input_lengths")
    if not 0 < length <= len(padded):
        raise ProbeError(f"{where}: input_lengths {length} does not fit the {len(padded)} token_ids")
    tokens = checked.ids(padded[:length], where, "token_ids")
    arrays = {}
    for key, what in (
        ("token_loss_mask", "which tokens the policy was trained on"),
        ("generation_logprobs", "the inference side's log-probs"),
        ("prev_logprobs", "the training side's log-probs"),
    ):
        values = checked.numbers(_unwrap(field(obj, key, where, what)), where, key)
        if len(values) < length:
            raise ProbeError(f"{where}: '{key}' has {len(values)} values, expected at least input_lengths {length}")
        arrays[key] = (checked.flags if key == "token_loss_mask" else checked.logprobs)(values[:length], where, key)
    mask = arrays["token_loss_mask"]
    if not mask.any():
        raise ProbeError(f"{where}: token_loss_mask has no non-zero value (expected the response's tokens marked)")
    start = int(np.argmax(mask))
    training = arrays["prev_logprobs"][mask]
    if not training.any() and arrays["generation_logprobs"][mask].any():
        raise ProbeError(
            f"{where}: prev_logprobs are all zero (NeMo-RL skipped the policy's log-probs, force_on_policy_ratio): "
            "the training side is missing; the rollout-vs-training comparison cannot be made"
        )
    return LoggedSample(
        prompt_ids=tokens[:start],
        response_ids=tokens[start:],
        inference_logprobs=arrays["generation_logprobs"][start:],
        training_logprobs=arrays["prev_logprobs"][start:],
        response_mask=mask[start:],
        step=step,
        where=where,
    )
