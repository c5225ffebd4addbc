"""Reading a checkpoint's config.json the way transformers does (class defaults, attribute maps),
including model types transformers does not register."""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json
from mismatch_probe.model.moe import MODEL_TYPE_ALIASES


def load_hf_config(path: Path, trust_remote_code: bool = False):
    """The transformers config object. `kimi_k2` and the like load as the architecture they are
    (MODEL_TYPE_ALIASES) unless `trust_remote_code` asks for the checkpoint's own code."""
    from transformers import CONFIG_MAPPING, AutoConfig

    config_path = Path(path) / "config.json"
    raw = read_json(config_path)
    alias = MODEL_TYPE_ALIASES.get(raw.get("model_type"))
    try:
        if alias and not trust_remote_code:
            return CONFIG_MAPPING[alias].from_dict({k: v for k, v in raw.items() if k != "model_type"})
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        hint = "" if trust_remote_code else "; if the checkpoint ships its own code, pass --trust-remote-code"
        raise ProbeError(f"{config_path}: transformers cannot read it ({str(exc).splitlines()[0]}){hint}") from exc
