"""The megatron shims apply by what is absent (TransformerEngine) and by device, not by device alone."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as mcore_random  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

from mismatch_probe.engines.megatron import shims as megatron_shims  # noqa: E402


@pytest.fixture
def fresh_shims(monkeypatch):
    monkeypatch.setattr(megatron_shims, "_applied", False)
    if not megatron_shims._use_te_installed():
        monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    return monkeypatch


def test_on_cuda_without_te_the_rng_is_seeded_and_te_general_gemm_defined(fresh_shims):
    seeds = []
    fresh_shims.setattr(mcore_random, "model_parallel_cuda_manual_seed", seeds.append)
    fresh_shims.setattr(mcore_random, "initialize_rng_tracker", lambda **kw: pytest.fail("CPU tracker on CUDA"))
    megatron_shims.apply_shims(cuda=True)
    assert seeds == [megatron_shims.RNG_SEED]
    if not megatron_shims._use_te_installed():
        assert moe_utils.te_general_gemm is None  # the NameError fix, on CUDA too


def test_on_cpu_the_inference_tracker_and_te_general_gemm(fresh_shims):
    calls = []
    fresh_shims.setattr(mcore_random, "initialize_rng_tracker", lambda **kw: calls.append(kw))
    fresh_shims.setattr(mcore_random, "model_parallel_cuda_manual_seed", lambda seed: pytest.fail("CUDA seed on CPU"))
    megatron_shims.apply_shims(cuda=False)
    assert calls == [{"inference_rng_tracker": True, "force_reset": True}]
    if not megatron_shims._use_te_installed():
        assert moe_utils.te_general_gemm is None
    megatron_shims.apply_shims(cuda=False)  # once per process
    assert len(calls) == 1
