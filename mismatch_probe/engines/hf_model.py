"""Loading a transformers causal LM in one of the engine dtypes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..errors import ProbeError
from ..hf_config import load_hf_config
from ..modelinfo import ModelInfo
from .base import DTYPES

# The dtype the weights are loaded in; fp32-bf16w then computes in fp32 on the bf16-rounded weights.
LOAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32-bf16w": torch.bfloat16}


def load_hf_model(model: ModelInfo, dtype: str) -> torch.nn.Module:
    if dtype not in DTYPES:
        raise ProbeError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    hf_logging.disable_progress_bar()  # our own progress bars are the ones that matter
    config = load_hf_config(model.path, model.trust_remote_code)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            model.path, config=config, dtype=LOAD_DTYPES[dtype], trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"{model.path}: cannot load model ({str(exc).splitlines()[0]})") from exc
    if dtype == "fp32-bf16w":
        hf = hf.float()
    return hf.eval()
