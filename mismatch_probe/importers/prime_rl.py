"""prime-rl token exports (`enable_token_export`): token_exports/step_N/rank_R.jsonl, one sequence per line.

Source read: PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/token_export.py (`TokenExporter.export`,
~line 42, and `_export_columns`, ~line 125): every line holds `token_ids`, `position_ids`, `loss_mask`,
`inference_logprobs` and `trainer_logprobs`, all of one length and aligned by index (the log-prob at i is
that of token i: src/prime_rl/trainer/rl/train.py ~452 shifts the trainer's right), plus `step`; non-finite floats are written as null. The tokens before the first
loss-masked one are the prompt; inside the response, tokens outside the loss mask (tool output in a
multi-turn sample) have no log-prob. The export carries no routing, model, engine, dtype or temperature.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.importers.base import Dump, dump_files, engines_not_in, field, jsonl_objects, step_in_name
from mismatch_probe.rundir.logged import LoggedSample, Provenance

COLUMNS = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")


def read(path: Path) -> Dump:
    files = dump_files(path, "*.jsonl", "prime-rl token exports (token_exports/step_N/rank_R.jsonl)")
    provenance = Provenance(
        source_format="prime-rl",
        source=str(path),
        training_engine="prime-rl trainer",
        lacks=engines_not_in("export"),
    )
    return Dump(provenance=provenance, samples=_samples(files))


def _samples(files: list[Path]) -> Iterator[LoggedSample]:
    for path in files:
        named = step_in_name(path)  # token_exports/step_N/rank_R.jsonl: the folder names the step
        for where, obj in jsonl_objects(path):
            yield sample(obj, where, named)


def sample(obj: dict, where: str, named_step: int | None = None) -> LoggedSample:
    columns = {key: field(obj, key, where, "a prime-rl token export line") for key in COLUMNS}
    lengths = {key: len(values) for key, values in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ProbeError(f"{where}: fields of different lengths {lengths} (expected one value per token)")
    tokens = np.asarray(columns["token_ids"], dtype=np.int64)
    mask = np.asarray(columns["loss_mask"], dtype=bool)  # true, 1 or any non-zero value: trained on
    if not mask.any():
        raise ProbeError(f"{where}: loss_mask has no true value (expected the response's tokens marked)")
    start = int(np.argmax(mask))
    # null (a non-finite value in the trainer) becomes NaN: no log-prob at that token
    inference = np.asarray(columns["inference_logprobs"], dtype=np.float64)[start:]
    training = np.asarray(columns["trainer_logprobs"], dtype=np.float64)[start:]
    return LoggedSample(
        prompt_ids=tokens[:start],
        response_ids=tokens[start:],
        inference_logprobs=inference,
        training_logprobs=training,
        response_mask=mask[start:],
        step=obj["step"] if obj.get("step") is not None else named_step,
        where=where,
    )
