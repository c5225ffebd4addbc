"""megatron-core TransformerConfig for an inference-only forward of an HF checkpoint."""

from __future__ import annotations

import torch

from mismatch_probe.engines.megatron.adapters import adapter_for, read_hf_config
from mismatch_probe.engines.megatron.overrides import EXPLICIT, SHAPE_FIELDS, mla_only_fields
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo
from mismatch_probe.vocab import BF16, COMPUTE_TORCH, FP16


def transformer_config(
    model: ModelInfo,
    dtype: str,
    tensor_parallel: int,
    expert_parallel: int,
    on_gpu: bool,
    use_transformer_engine: bool = False,
    overrides: dict | None = None,
):
    """The adapter's settings from config.json over probe's inference settings, then `overrides`
    (`--engine-arg override_transformer_config.*`, already typed and checked) over both."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    adapter, hf = adapter_for(model), read_hf_config(model)
    kwargs = adapter.config_kwargs(hf)
    if any(adapter.moe_layers(hf)):
        kwargs.update(
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_enable_routing_replay=True,
            expert_model_parallel_size=expert_parallel,
        )
    config_class = MLATransformerConfig if adapter.multi_latent_attention else TransformerConfig
    settings = dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=getattr(torch, COMPUTE_TORCH[dtype]),
        bf16=dtype == BF16,
        fp16=dtype == FP16,
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
        # What is built (layer spec), so that the manifest's record of the config says it.
        transformer_impl="transformer_engine" if use_transformer_engine else "local",
    )
    overrides = overrides or {}
    _check_against_checkpoint(overrides, kwargs, config_class is MLATransformerConfig)
    try:
        config = config_class(**{**settings, **kwargs, **overrides})
    except (AssertionError, ValueError) as err:  # megatron-core's own checks of a combination of fields
        if not overrides:
            raise
        raise ProbeError(f"{OVERRIDES}: megatron-core refuses the configuration: {err}") from None
    # GPTModel and Attention read the YaRN settings of non-MLA models as attributes the
    # dataclass does not declare (megatron's own argument parser sets them the same way).
    for name, value in adapter.config_attributes(hf).items():
        setattr(config, name, value)
    return config


OVERRIDES = EXPLICIT.rstrip(".")


def _check_against_checkpoint(overrides: dict, derived: dict, multi_latent: bool) -> None:
    """A field that fixes a weight's shape must say what config.json says; MLA fields need an MLA model."""
    for name, value in overrides.items():
        if name in SHAPE_FIELDS and name in derived and value != derived[name]:
            raise ProbeError(
                f"{EXPLICIT}{name}={value}: the checkpoint's config.json gives {derived[name]} (the weights' shape)"
            )
    if not multi_latent:
        mla = sorted(set(overrides) & mla_only_fields())
        if mla:
            raise ProbeError(f"{EXPLICIT}{mla[0]}: a multi-latent-attention field; this model has none")
