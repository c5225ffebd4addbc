"""Mixtral: no q/k norm; softmax -> top-k -> renormalise (always); every layer MoE."""

from __future__ import annotations

from mismatch_probe.engines.megatron.adapters.checkpoint import HFCheckpoint
from mismatch_probe.engines.megatron.adapters.moe import MoeAdapter


class MixtralAdapter(MoeAdapter):
    architectures = ("MixtralForCausalLM",)
    expert_weights = ("w1", "w3", "w2")

    def missing_feature(self, hf: dict) -> str | None:
        if hf.get("sliding_window") is not None:
            return "sliding-window attention (sliding_window)"
        return super().missing_feature(hf)

    def moe_layers(self, hf: dict) -> list[bool]:
        return [bool(self.num_experts(hf))] * hf["num_hidden_layers"]

    def normalises_top_k(self, hf: dict) -> bool:
        return True

    def moe_prefix(self, ckpt: HFCheckpoint, layer_prefix: str) -> str:
        # Original Mixtral checkpoints name the MoE block `block_sparse_moe`; later saves use `mlp`.
        legacy = layer_prefix + "block_sparse_moe."
        return legacy if legacy + "gate.weight" in ckpt else layer_prefix + "mlp."
