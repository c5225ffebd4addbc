"""Prompts from JSONL, tokenized once: the stored ids are what every engine sees."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from mismatch_probe.errors import ProbeError


def load_prompts(path: Path, model_path: Path, trust_remote_code: bool = False) -> list[list[int]]:
    """One prompt per line: {"prompt": text}, {"messages": [...]} (chat template) or {"input_ids": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"{path}: prompts file not found")
    tokenizer = None
    prompts: list[list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ProbeError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(item, dict):
            raise ProbeError(f"{path}:{lineno}: expected an object with 'prompt', 'messages' or 'input_ids'")
        if "input_ids" in item:
            ids = item["input_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
                raise ProbeError(f"{path}:{lineno}: 'input_ids' must be a non-empty list of token ids")
            prompts.append(ids)
            continue
        tokenizer = tokenizer or _tokenizer(model_path, trust_remote_code)
        if "messages" in item:
            if not tokenizer.chat_template:
                raise ProbeError(f"{path}:{lineno}: 'messages' given but {model_path} has no chat template")
            ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        elif isinstance(item.get("prompt"), str):
            ids = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise ProbeError(f"{path}:{lineno}: expected a 'prompt' string, 'messages' or 'input_ids'")
        if not ids:
            raise ProbeError(f"{path}:{lineno}: prompt tokenizes to nothing")
        prompts.append([int(i) for i in ids])
    if not prompts:
        raise ProbeError(f"{path}: no prompts")
    return prompts


def _tokenizer(model_path: Path, trust_remote_code: bool):
    try:  # an explicit trust_remote_code: transformers would otherwise stop to ask on a checkpoint with auto_map
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ProbeError(f"{model_path}: cannot load tokenizer ({str(exc).splitlines()[0]})") from exc
