"""Loading a transformers causal LM in one of the engine dtypes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..errors import ProbeError
from ..modelinfo import ModelInfo
from .base import DTYPES


def load_hf_model(model: ModelInfo, dtype: str) -> torch.nn.Module:
    if dtype not in DTYPES:
        raise ProbeError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    hf_logging.disable_progress_bar()  # our own progress bars are the ones that matter
    load_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    try:
        hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=load_dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"{model.path}: cannot load model ({str(exc).splitlines()[0]})") from exc
    if dtype == "fp32-bf16w":
        hf = hf.float()
    return hf.eval()
