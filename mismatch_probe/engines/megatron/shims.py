"""Every shim megatron-core needs here (CPU, and CUDA without TransformerEngine), and its process-group setup.

Every shim names the megatron-core version whose code needs it and why; the package is pinned
(pyproject.toml), so re-check them when the pin moves. Which apply where:

| shim | CPU | CUDA, no TE | CUDA + TE |
|---|---|---|---|
| `moe_utils.te_general_gemm = None` | yes | yes | no (TE defines it) |
| RNG tracker: inference tracker (CPU) / `model_parallel_cuda_manual_seed` (CUDA) | yes | yes | yes |
| CPU sliding-window mask, `cpu_device_scope` (device and stream queries) | yes | no | no |
| local MLA core attention (`local_mla_core_attention`) | local layer spec only | same | no (TE's spec) |
| `attention_backend_env` (NVTE_* of the previous build) | yes | yes | yes |
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

_applied = False

# megatron-core announces every optional accelerator package it cannot find (Apex, TE) at import.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")


# megatron's RNG tracker only seeds dropout and weight init; probe loads every weight and runs no dropout,
# so the seed changes no number. Fixed, so that builds are reproducible all the same.
RNG_SEED = 1234


def apply_shims(cuda: bool | None = None) -> None:
    """Process-wide shims for this device; safe to call any number of times."""
    global _applied
    if _applied:
        return
    cuda = torch.cuda.is_available() if cuda is None else cuda
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1: moe_utils imports te_general_gemm only when TransformerEngine is
    # installed, yet router_gating_linear tests `te_general_gemm is not None` unconditionally:
    # a NameError wherever TE is absent, CPU or CUDA. None selects its plain torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if cuda:
        # megatron-core 0.16.1: building a model forks the "model-parallel-rng" CUDA RNG state, which
        # only model_parallel_cuda_manual_seed adds ("cuda rng state model-parallel-rng is not added").
        mcore_random.model_parallel_cuda_manual_seed(RNG_SEED)
    else:
        # megatron-core 0.16.1: the training RNG tracker seeds through torch.cuda; the inference
        # tracker forks nothing. We only run forwards from loaded weights, so no RNG is consumed.
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        # megatron-core 0.16.1: the torch softmax path builds its sliding-window mask with
        # device="cuda" (transformer.utils.get_sliding_window_causal_mask). The same mask, on the CPU.
        fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask
    _applied = True


def _use_te_installed() -> bool:
    from megatron.core.extensions import transformer_engine as mcore_te

    return bool(mcore_te.HAVE_TE)


def _sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """True = masked: keys more than window_size[0] before or window_size[1] after the query."""
    query = torch.arange(sq)[:, None] + (skv - sq)
    key = torch.arange(skv)[None, :]
    return (key < query - window_size[0]) | (key > query + window_size[1])


@contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Make `torch.cuda.current_device()` answer "cpu" while megatron builds and runs the model.

    megatron-core 0.16.1 allocates with `device=torch.cuda.current_device()` in
    GlobalMemoryBuffer.get_tensor, Router.gating (moves the router weight "to the GPU"),
    tensor_parallel.mappings (all-gather / reduce-scatter buffers when TP or EP > 1),
    SequentialMLP and the rotary embedding. Without CUDA each of those raises; on CPU the
    right answer is the CPU. Scoped, so code outside megatron never sees the change.
    """
    if torch.cuda.is_available():
        yield
        return
    stand_ins = {
        "current_device": lambda: torch.device("cpu"),
        # megatron-core 0.16.1: the alltoall token dispatcher creates a side stream for its device-to-host
        # copies (MoEAlltoAllTokenDispatcher.cuda_dtoh_stream) and enters it every forward. On the CPU
        # there is one stream, program order: a stream that orders nothing and an event already reached.
        "Stream": lambda *args, **kwargs: _HOST_STREAM,
        "current_stream": lambda *args, **kwargs: _HOST_STREAM,
        "stream": lambda *args, **kwargs: nullcontext(),
    }
    originals = {name: getattr(torch.cuda, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(torch.cuda, name, stand_in)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.cuda, name, original)


class _HostEvent:
    def synchronize(self) -> None:
        pass


class _HostStream:
    """The one CPU stream: waiting on another stream or on an event it recorded has nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


_HOST_STREAM = _HostStream()


NVTE_BACKEND_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_exported_backend: dict[str, str] = {}


@contextmanager
def attention_backend_env() -> Iterator[None]:
    """Build a model with the environment its attention_backend sets, not the previous build's.

    megatron-core 0.16.1: LanguageModule._set_attention_backend exports NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
    NVTE_UNFUSED_ATTN for the config's attention_backend (TE reads them when it runs) and asserts that a
    value already set agrees. A second model built in the same process with another backend (an
    override, tests, `probe locate`) would fail that assertion on the first build's values: those are
    dropped first. Values the user exported before any build are left alone, and megatron still checks them.
    """
    for name, value in list(_exported_backend.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
    _exported_backend.clear()
    before = {name: os.environ.get(name) for name in NVTE_BACKEND_VARS}
    try:
        yield
    finally:
        for name in NVTE_BACKEND_VARS:
            if before[name] is None and name in os.environ:
                _exported_backend[name] = os.environ[name]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group() -> None:
    """Join the torchrun job when launched by torchrun, else start a one-process group."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["WORLD_SIZE"], os.environ["RANK"], os.environ["LOCAL_RANK"] = "1", "0", "0"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)


def init_model_parallel(tensor_parallel: int, expert_parallel: int) -> None:
    """(Re)initialise megatron's parallel state for these sizes over the whole world."""
    from megatron.core import parallel_state as ps

    init_process_group()
    world = dist.get_world_size()
    if world % tensor_parallel or world % expert_parallel:
        from mismatch_probe.errors import ProbeError

        raise ProbeError(
            f"--engine-arg tensor_parallel={tensor_parallel} / expert_parallel={expert_parallel}: "
            f"must divide the number of processes ({world})"
        )
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tensor_parallel
            and ps.get_expert_model_parallel_world_size() == expert_parallel
        )
        if same:
            return
        ps.destroy_model_parallel()
    with cpu_device_scope():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            expert_model_parallel_size=expert_parallel,
            create_gloo_process_groups=False,
        )
    apply_shims()


def local_mla_core_attention(block_spec) -> None:
    """Let multi-latent attention run on the local (non-TransformerEngine) layer spec.

    megatron-core 0.16.1: MLASelfAttention builds its core attention with `k_channels` and
    `v_channels`, which only TEDotProductAttention accepts; the local DotProductAttention has no
    such arguments and sizes its output by `config.kv_channels`. With kv_channels = v_head_dim its
    computation is exactly MLA's (the key width comes from the tensors), so the local spec gets a
    DotProductAttention that takes the two arguments and checks the value width (the base
    Attention first builds a core attention without them, which MLASelfAttention then replaces).

    Also megatron-core 0.16.1: without TransformerEngine, extensions.transformer_engine imports
    fine with MagicMock classes, so multi_latent_attention sets its HAVE_TE to True and then calls
    `isinstance(linear_proj, TELinear)` with a mock (TypeError). Tell it the truth.
    """
    from megatron.core.extensions import transformer_engine as mcore_te
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not mcore_te.HAVE_TE:
        multi_latent_attention.HAVE_TE = False

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            if v_channels not in (None, config.kv_channels):
                raise ValueError(f"MLA core attention: v_channels {v_channels} != kv_channels {config.kv_channels}")
            super().__init__(config, *args, **kwargs)

    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention and attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = MLADotProductAttention
