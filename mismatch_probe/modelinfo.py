"""What a checkpoint's config says about its MoE routing (through the family's adapter), for every engine to share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ProbeError
from .hf_config import load_hf_config
from .moe import EXPERT_COUNT_KEYS, MoeShape, adapter_for, supported_names
from .jsonfile import read_json
from .schema import RoutingShape


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    model_type: str
    architecture: str
    num_hidden_layers: int
    vocab_size: int
    moe_layer_indices: tuple[int, ...]
    top_k: int
    num_experts: int
    config_hash: str
    moe_family: str | None = None  # the routing adapter's family; None for dense models
    trust_remote_code: bool = False

    @property
    def routing(self) -> RoutingShape:
        if not self.moe_layer_indices:
            return RoutingShape()
        return RoutingShape(num_layers=len(self.moe_layer_indices), top_k=self.top_k, num_experts=self.num_experts)

    def manifest_fields(self) -> dict:
        return {
            "model": str(self.path),
            "model_type": self.model_type,
            "architecture": self.architecture,
            "config_hash": self.config_hash,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "num_layers": len(self.moe_layer_indices),
            "top_k": self.top_k if self.moe_layer_indices else 0,
            "num_experts": self.num_experts if self.moe_layer_indices else 0,
            "moe_layer_indices": list(self.moe_layer_indices),
        }


def _moe_shape(config, raw: dict, config_path: Path) -> tuple[str | None, MoeShape]:
    """The family's adapter reads the shape; a config with experts but no adapter is refused, never dense."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or raw["model_type"]
    adapter = adapter_for(model_type) or adapter_for(raw["model_type"])
    if adapter is not None:
        try:
            return adapter.family, adapter.shape(text)
        except ProbeError as exc:
            raise ProbeError(f"{config_path}: {exc}") from None
    fields = {**raw, **text.to_dict()}
    experts = {key: fields[key] for key in EXPERT_COUNT_KEYS if isinstance(fields.get(key), int) and fields[key] > 0}
    if experts:
        architecture = (raw.get("architectures") or [raw["model_type"]])[0]
        found = ", ".join(f"{k}={v}" for k, v in experts.items())
        raise ProbeError(
            f"{config_path}: '{architecture}' (model_type '{model_type}') has experts ({found}) but no MoE routing "
            f"adapter; supported: {supported_names()}"
        )
    return None, MoeShape(num_experts=0, top_k=0, moe_layers=())


def load_model_info(path: str | Path, trust_remote_code: bool = False) -> ModelInfo:
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ProbeError(f"{path}: not a model folder (no config.json)")
    raw = read_json(config_path)
    if "model_type" not in raw:
        raise ProbeError(f"{config_path}: missing 'model_type'")
    config = load_hf_config(path, trust_remote_code)
    text = config.get_text_config()
    for key in ("num_hidden_layers", "vocab_size"):
        if getattr(text, key, None) is None:
            raise ProbeError(f"{config_path}: missing '{key}'")
    family, shape = _moe_shape(config, raw, config_path)
    return ModelInfo(
        path=path.resolve(),
        model_type=raw["model_type"],
        architecture=(raw.get("architectures") or [raw["model_type"]])[0],
        num_hidden_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        moe_layer_indices=shape.moe_layers,
        top_k=shape.top_k,
        num_experts=shape.num_experts,
        config_hash=hashlib.sha256(config_path.read_bytes()).hexdigest()[:16],
        moe_family=family,
        trust_remote_code=trust_remote_code,
    )

