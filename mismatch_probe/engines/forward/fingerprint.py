"""A fingerprint of the weights an engine actually holds, recorded in its manifest (engine.weights_fingerprint).

sha256 over a few fixed tensors: the input embeddings, the output embeddings and the final norm, the
embeddings on up to ROWS evenly spaced rows of the true vocabulary (Megatron pads it). Values are rounded
to bf16 first, so an fp32, bf16 or fp32-bf16w engine holding the same checkpoint gives the same
fingerprint; fp16 weights hash as fp16 and are compared only with fp16 ones. `probe doctor` reports
weights_differ when the rollout's and a score set's fingerprints differ. Engines whose weights sit in
another process (sglang, vllm servers) record none.
"""

from __future__ import annotations

import hashlib

import torch

ROWS = 4096


def _rows(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    step = max(1, vocab_size // ROWS)
    return weight[:vocab_size:step]


def fingerprint(tensors: dict[str, torch.Tensor | None], vocab_size: int) -> dict | None:
    """{"sha256", "tensors", "rounding"}; None when a tensor is missing."""
    if any(t is None for t in tensors.values()):
        return None
    fp16 = any(t.dtype == torch.float16 for t in tensors.values())
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        t = tensor.detach()
        t = _rows(t, vocab_size) if name.endswith("embeddings") else t
        t = t.to(torch.float16 if fp16 else torch.bfloat16).contiguous().cpu()
        digest.update(name.encode())
        digest.update(t.view(torch.int16).numpy().tobytes())
    return {"sha256": digest.hexdigest(), "tensors": list(tensors), "rounding": "fp16" if fp16 else "bf16"}


def hf_fingerprint(hf: torch.nn.Module, vocab_size: int) -> dict | None:
    norm = getattr(hf.base_model, "norm", None)
    output = hf.get_output_embeddings()
    tensors = {
        "input_embeddings": hf.get_input_embeddings().weight,
        "output_embeddings": output.weight if output is not None else None,
    }
    if isinstance(getattr(norm, "weight", None), torch.Tensor):
        tensors["final_norm"] = norm.weight
    return fingerprint(tensors, vocab_size)


def megatron_fingerprint(module, vocab_size: int, tensor_parallel: int) -> dict | None:
    """None under tensor parallelism: each rank holds a shard of the embeddings."""
    if tensor_parallel > 1:
        return None
    embedding = module.embedding.word_embeddings.weight
    output = getattr(module.output_layer, "weight", None)
    tensors = {"input_embeddings": embedding, "output_embeddings": output if output is not None else embedding}
    norm = getattr(module.decoder, "final_layernorm", None)
    if isinstance(getattr(norm, "weight", None), torch.Tensor):
        tensors["final_norm"] = norm.weight
    return fingerprint(tensors, vocab_size)
