"""What a checkpoint's config says about its MoE routing (through the family's adapter), for every engine to share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json
from mismatch_probe.model.hf_config import load_hf_config
from mismatch_probe.model.moe import EXPERT_COUNT_KEYS, MoeShape, adapter_chosen, adapter_for, supported_names
from mismatch_probe.model.moe.recognise import Recognition, recognise_checkpoint
from mismatch_probe.schema import RoutingShape


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


def _moe_shape(
    config, raw: dict, config_path: Path, trust_remote_code: bool, moe_family: str | None
) -> tuple[str | None, MoeShape]:
    """The family's adapter reads the shape. The family is `--moe-family`'s, else the model_type's, else the one
    the model's modules are (remote code). A model with experts or routers but no family is refused, never dense."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or raw["model_type"]
    fields = {**raw, **text.to_dict()}
    experts = {key: fields[key] for key in EXPERT_COUNT_KEYS if isinstance(fields.get(key), int) and fields[key] > 0}
    adapter = adapter_chosen(moe_family) if moe_family else adapter_for(model_type) or adapter_for(raw["model_type"])
    recognised = Recognition(adapter=None)
    if adapter is None and (experts or trust_remote_code):  # remote code may spell its expert count otherwise
        recognised = recognise_checkpoint(config, trust_remote_code)
        adapter = recognised.adapter
    if adapter is not None:
        try:
            shape = adapter.shape(text)
        except ProbeError as exc:
            raise ProbeError(f"{config_path}: {exc}") from None
        if not shape.num_experts and (moe_family or recognised.adapter):
            raise ProbeError(
                f"{config_path}: the model is {adapter.family}, but config.json has no "
                f"'{adapter.num_experts_key}' and '{adapter.top_k_key}' (what that family calls them)"
            )
        return adapter.family, shape
    if experts or recognised.router_like or recognised.misfits:
        architecture = (raw.get("architectures") or [raw["model_type"]])[0]
        found = (
            f"experts ({', '.join(f'{k}={v}' for k, v in experts.items())})"
            if experts
            else f"router modules ({recognised.router_like})"
        )
        why = "".join(f" ({reason})" for reason in (recognised.misfits[:1] or [recognised.failure]) if reason)
        raise ProbeError(
            f"{config_path}: '{architecture}' (model_type '{model_type}') has {found} but no MoE routing adapter"
            f"{why}; supported: {supported_names()}; if it routes as one of them, name it with --moe-family"
        )
    return None, MoeShape(num_experts=0, top_k=0, moe_layers=())


def load_model_info(path: str | Path, trust_remote_code: bool = False, moe_family: str | None = None) -> ModelInfo:
    """`moe_family` (--moe-family) names the MoE family where neither model_type nor modules do."""
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
    family, shape = _moe_shape(config, raw, config_path, trust_remote_code, moe_family)
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
