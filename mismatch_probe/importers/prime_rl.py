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
from mismatch_probe.rundir import checked
from mismatch_probe.rundir.logged import LoggedSample, Provenance

COLUMNS = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")


def read(path: Path, trust_pickle: bool = False) -> Dump:
    """`trust_pickle` is unused: a JSONL export holds no pickle."""
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
    tokens = checked.ids(columns["token_ids"], where, "token_ids")
    mask = checked.flags(columns["loss_mask"], where, "loss_mask")  # true, 1 or any non-zero value: trained on
    # null (a non-finite value in the trainer) becomes NaN: no log-prob at that token
    sides = {key: checked.logprobs(columns[key], where, key) for key in ("inference_logprobs", "trainer_logprobs")}
    checked.lengths_agree(where, {"loss_mask": mask, **sides}, len(tokens), "token in 'token_ids'")
    if not mask.any():
        raise ProbeError(f"{where}: loss_mask has no true value (expected the response's tokens marked)")
    start = int(np.argmax(mask))
    return LoggedSample(
        prompt_ids=tokens[:start],
        response_ids=tokens[start:],
        inference_logprobs=sides["inference_logprobs"][start:],
        training_logprobs=sides["trainer_logprobs"][start:],
        response_mask=mask[start:],
        step=obj["step"] if obj.get("step") is not None else named_step,
        where=where,
    )
