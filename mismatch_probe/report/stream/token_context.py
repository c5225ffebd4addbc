"""Decoded text for the worst tokens: the stored token ids decoded with the run's tokenizer, never re-tokenized.

Runs after the streaming pass: the few samples involved are read back from the rollout (a filter on
sample_id, so Parquet skips the other row groups) and the tokenizer is loaded once for all comparisons.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds

from mismatch_probe.errors import ProbeError
from mismatch_probe.report.accumulators.worst_tokens import WorstTokens
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import READ_ERRORS, require_parts

PROMPT_TAIL_TOKENS = 32  # the end of the prompt shown before the response
RESPONSE_CONTEXT_TOKENS = 256  # at most this many response tokens before the worst token


def load_tokenizer(model: str | None):
    """(tokenizer, None), or (None, why not) when the run's model folder has no loadable tokenizer."""
    if not model:  # an imported or recorded run whose source names no model
        return None, "the run's manifest names no model"
    if not Path(model).is_dir():
        return None, f"model folder {model} not found"
    from transformers import AutoTokenizer

    try:
        # trust_remote_code given: transformers would otherwise stop to ask on a checkpoint with auto_map.
        return AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=False), None
    except Exception as exc:  # noqa: BLE001 - any failure to load means: no text, said in a note
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"cannot load the tokenizer of {model} ({reason})"


def read_samples(run: Run, sample_ids: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """sample_id -> (token ids by position, is_response by position) from the rollout."""
    parts = require_parts(run.rollout_dir)
    columns = ["sample_id", "position", "token_id", "is_response"]
    try:
        table = ds.dataset(parts, format="parquet").to_table(
            columns=columns, filter=pc.field("sample_id").isin(sample_ids)
        )
    except READ_ERRORS as exc:
        raise ProbeError(f"{run.rollout_dir}: cannot read the worst tokens' samples ({exc})") from exc
    table = table.sort_by([("sample_id", "ascending"), ("position", "ascending")])
    sample = table.column("sample_id").to_numpy()
    tokens = table.column("token_id").to_numpy().astype(np.int64)
    response = table.column("is_response").to_numpy(zero_copy_only=False)
    bounds = np.flatnonzero(np.diff(sample)) + 1
    return {
        int(ids[0]): (tok, resp)
        for ids, tok, resp in zip(np.split(sample, bounds), np.split(tokens, bounds), np.split(response, bounds))
        if len(ids)
    }


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def decode_entry(entry: dict, tokens: np.ndarray, is_response: np.ndarray, tokenizer) -> None:
    """Fill the texts of one worst-token entry from its sample's stored ids."""
    first_response = int(np.argmax(is_response)) if is_response.any() else len(tokens)
    prompt = tokens[:first_response]
    position = entry["position"]
    before = tokens[max(first_response, position - RESPONSE_CONTEXT_TOKENS) : position]
    entry["token"] = _decode(tokenizer, [entry["token_id"]])
    for side in ("ref", "cand"):
        top = entry[f"top_token_id_{side}"]
        entry[f"top_token_{side}"] = None if top is None else _decode(tokenizer, [top])
    entry["context"] = {
        "prompt_tail": _decode(tokenizer, prompt[-PROMPT_TAIL_TOKENS:]),
        "response_before": _decode(tokenizer, before),
    }


def attach_context(run: Run, model: str, worst: list[WorstTokens]) -> None:
    """Decode every entry of every comparison; where that is impossible, texts stay null and a note says why."""
    wanted = sorted({e["sample_id"] for w in worst for e in w.entries})
    if not wanted:
        return
    tokenizer, problem = load_tokenizer(model)
    if tokenizer is not None:
        samples = read_samples(run, wanted)
        try:
            for entry in (e for w in worst for e in w.entries):
                decode_entry(entry, *samples[entry["sample_id"]], tokenizer)
        except (IndexError, KeyError, TypeError, ValueError, OverflowError) as exc:
            reason = (str(exc).strip().splitlines() or [""])[0]
            problem = f"the tokenizer of {model} cannot decode the stored ids ({type(exc).__name__}: {reason})"
            _clear_texts(worst)
    if problem is not None:
        for w in worst:
            if w.entries:
                w.notes.append(f"worst_tokens: token texts are null: {problem}")


def _clear_texts(worst: list[WorstTokens]) -> None:
    for entry in (e for w in worst for e in w.entries):
        entry.update(token=None, top_token_ref=None, top_token_cand=None)
        entry["context"] = {"prompt_tail": None, "response_before": None}
