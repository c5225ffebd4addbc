"""What a checkpoint's config.json says about its MoE routing, for every engine to share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ProbeError
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

    @property
    def routing(self) -> RoutingShape:
        if not self.moe_layer_indices:
            return RoutingShape()
        return RoutingShape(len(self.moe_layer_indices), self.top_k, self.num_experts)

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


def _moe_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not num_experts or not cfg.get("num_experts_per_tok"):
        return ()
    if "first_k_dense_replace" in cfg:  # DeepSeek-style
        freq = cfg.get("moe_layer_freq", 1)
        return tuple(i for i in range(n_layers) if i >= cfg["first_k_dense_replace"] and i % freq == 0)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    return tuple(i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0)


def load_model_info(path: str | Path) -> ModelInfo:
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ProbeError(f"{path}: not a model folder (no config.json)")
    cfg = read_json(config_path)
    for key in ("num_hidden_layers", "vocab_size", "model_type"):
        if key not in cfg:
            raise ProbeError(f"{config_path}: missing '{key}'")
    n_layers = int(cfg["num_hidden_layers"])
    moe = _moe_layers(cfg, n_layers)
    return ModelInfo(
        path=path.resolve(),
        model_type=cfg["model_type"],
        architecture=(cfg.get("architectures") or [cfg["model_type"]])[0],
        num_hidden_layers=n_layers,
        vocab_size=int(cfg["vocab_size"]),
        moe_layer_indices=moe,
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0),
        config_hash=hashlib.sha256(config_path.read_bytes()).hexdigest()[:16],
    )

