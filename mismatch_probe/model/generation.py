"""A checkpoint's generation config, read in one place for every engine and loading path.

transformers' `from_pretrained` reads `generation_config.json` beside `config.json`; a model built another way
(an FP8 checkpoint loaded from its state dict, `from_pretrained(None, ...)`) gets only what `config.json` says.
Real Qwen3 FP8 checkpoints name `<|im_end|>` in config.json and add `<|endoftext|>` in generation_config.json,
so a model without the second file's ids samples past an end token. Every load goes through here instead.
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.errors import ProbeError

GENERATION_CONFIG = "generation_config.json"


def checkpoint_generation_config(path: str | Path, config):
    """The GenerationConfig transformers' `from_pretrained` would give the checkpoint at `path`: its
    generation_config.json where there is one, else the one derived from `config` (the model config)."""
    from transformers import GenerationConfig

    if (Path(path) / GENERATION_CONFIG).is_file():
        try:
            return GenerationConfig.from_pretrained(path)
        except (OSError, ValueError, TypeError) as exc:
            raise ProbeError(f"{Path(path) / GENERATION_CONFIG}: cannot read it ({str(exc).splitlines()[0]})") from exc
    return GenerationConfig.from_model_config(config)


def as_ids(value) -> list[int]:
    """An eos_token_id field (None, one id, or a list) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list | tuple) else [value])]


def end_ids(path: str | Path, config) -> list[int]:
    """The end ids a serving engine stops at for this checkpoint: generation_config.json's and config.json's
    (SGLang and vLLM take both), sorted, without repeats."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    ids = as_ids(checkpoint_generation_config(path, config).eos_token_id) + as_ids(getattr(text, "eos_token_id", None))
    return sorted(set(ids))
