"""What this machine must have for an override: the packages (`NEEDS`) and the layer spec it asks for.

Every check looks the package up (importlib.util.find_spec) when the options are parsed, so a missing one
exits 2 naming it before any folder is made, never ignored.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mismatch_probe.engines.megatron.overrides import EXPLICIT, Entry
from mismatch_probe.errors import ProbeError

TE, LOCAL = "te", "local"
TE_PACKAGE = "transformer_engine"


@dataclass(frozen=True)
class Need:
    """`field` set to a value for which `when` holds needs `package` installed (looked up as `module`, which
    defaults to the package's name), unless the TE layer spec is built and brings its own (`te_suffices`)."""

    field: str
    when: Callable[[object], bool]
    package: str
    why: str
    module: str = ""
    te_suffices: bool = False


def _on(value) -> bool:
    return bool(value)


def _named(*names: str) -> Callable[[object], bool]:
    return lambda value: getattr(value, "name", value) in names


def _set(value) -> bool:
    return value is not None


# What megatron-core 0.16.1 calls for each setting (each found by building a tiny model with it on this CPU).
# Fusions not listed (masked_softmax_fusion, bias_activation_fusion, bias_dropout_fusion) fall back to torch
# and run here; moe_token_dispatcher_type=alltoall runs on the CPU through shims.cpu_device_scope.
NEEDS = (
    # megatron-core's own attention (the local spec) is unfused; flash and fused are TE's DotProductAttention.
    Need(
        field="attention_backend", when=_named("flash", "fused"), package=TE_PACKAGE, why="TE's flash/fused attention"
    ),
    # The transformer_engine layer spec builds TE modules throughout.
    Need(field="transformer_impl", when=_named("transformer_engine"), package=TE_PACKAGE, why="the TE layer spec"),
    # Local spec: GroupedMLP calls the grouped_gemm package (the TE spec's TEGroupedMLP calls TE).
    Need(field="moe_grouped_gemm", when=_on, package="grouped_gemm", why="GroupedMLP's grouped GEMM", te_suffices=True),
    # moe_utils.fused_permute / fused_unpermute exist only when TE is installed.
    Need(field="moe_permute_fusion", when=_on, package=TE_PACKAGE, why="TE's fused token permutation"),
    # The fused top-k with score function is TE's (>= 2.6).
    Need(field="moe_router_fusion", when=_on, package=TE_PACKAGE, why="TE's fused router top-k"),
    # Fused RoPE is TE's (>= 1.4).
    Need(field="apply_rope_fusion", when=_on, package=TE_PACKAGE, why="TE's fused RoPE"),
    # Local spec: the norm is apex's FusedLayerNorm when apex is installed; torch's norm refuses the flag.
    Need(
        field="persist_layer_norm",
        when=_on,
        package="apex",
        why="apex's persistent layer-norm kernel",
        te_suffices=True,
    ),
    # Local spec: the linears call apex's fused_weight_gradient_mlp_cuda extension (TE's linears fuse their own).
    Need(
        field="gradient_accumulation_fusion",
        when=_on,
        package="apex (fused_weight_gradient_mlp_cuda)",
        module="fused_weight_gradient_mlp_cuda",
        why="apex's fused weight-gradient kernel",
        te_suffices=True,
    ),
    # The flex dispatcher runs DeepEP or HybridEP, both from the deep_ep package.
    Need(field="moe_token_dispatcher_type", when=_named("flex"), package="deep_ep", why="DeepEP"),
    # FP8 / FP4 GEMMs and TE's RNG tracker exist only in TE.
    Need(field="fp8", when=_set, package=TE_PACKAGE, why="TE's FP8 GEMMs"),
    Need(field="fp4", when=_set, package=TE_PACKAGE, why="TE's FP4 GEMMs"),
    Need(field="use_te_rng_tracker", when=_on, package=TE_PACKAGE, why="TE's RNG tracker"),
    # Tensor-parallel communication overlap runs on TE's userbuffers.
    Need(field="tp_comm_overlap", when=_on, package=TE_PACKAGE, why="TE's userbuffers"),
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def te_usable() -> bool:
    """TransformerEngine imports and a CUDA device can run it (a TE build that fails to import is no TE)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _wanted_spec(overrides: Mapping[str, object]) -> str | None:
    """The layer spec transformer_impl / attention_backend ask for (None: no preference); "both" on a conflict.
    Megatron-LM's rule: attention_backend=local is the local spec's attention, flash and fused are TE's."""
    impl = overrides.get("transformer_impl")
    backend = getattr(overrides.get("attention_backend"), "name", None)
    local = impl == "local" or backend == "local"
    te = impl == "transformer_engine" or backend in ("flash", "fused")
    return "both" if local and te else LOCAL if local else TE if te else None


def _where(sources: Mapping[str, Entry], field: str, value) -> str:
    entry = sources.get(field)
    return entry.label(with_value=True) if entry else f"{EXPLICIT}{field}={getattr(value, 'name', value)}"


def choose_layer_spec(overrides: Mapping[str, object], sources: Mapping[str, Entry] | None = None) -> str:
    """The layer spec to build, TE or LOCAL: what transformer_impl / attention_backend ask for, else TE wherever
    it can run (CUDA, and TE imports). Checks first that the overrides' packages are installed (exit 2 naming
    the one that is not), then that the spec can be built here."""
    sources = sources or {}
    wanted = _wanted_spec(overrides)
    spec = TE if wanted == TE or (wanted is None and te_usable()) else LOCAL
    for need in NEEDS:
        value = overrides.get(need.field)
        if need.field not in overrides or not need.when(value):
            continue
        if (spec == TE and need.te_suffices) or _installed(need.module or need.package):
            continue
        where = _where(sources, need.field, value)
        raise ProbeError(f"{where}: needs {need.package}, which is not installed ({need.why})")
    impl = overrides.get("transformer_impl")
    if impl == "inference_optimized":
        where = _where(sources, "transformer_impl", impl)
        raise ProbeError(f"{where}: probe builds the local or the transformer_engine layer spec")
    if wanted == "both":
        raise ProbeError(
            f"{_where(sources, 'attention_backend', overrides['attention_backend'])} and "
            f"{_where(sources, 'transformer_impl', impl)}: one asks for the local layer spec, the other for TE's"
        )
    if spec == TE and not torch.cuda.is_available():
        where = _where(
            sources, "transformer_impl" if impl else "attention_backend", impl or overrides.get("attention_backend")
        )
        raise ProbeError(f"{where}: the TransformerEngine layer spec needs a CUDA device (this machine has none)")
    return spec
