"""`router_dtype=fp32` in every MoE family (tests/moe_families.py): the router's own output against its product
computed in fp32 by hand and the family's expert choice recomputed from it naively; the gate weights left in the
dtype the model's own router gives them; self-replay (R3) still bitwise; switching back bitwise; at fp32, and in
the families whose transformers router already runs in fp32, nothing changes at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moe_families import FAMILIES, naive_choice, save_family

from mismatch_probe.engines import training_engine
from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.engines.hf import routing as hf_routing
from mismatch_probe.model.moe import adapter_for
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import ScoreRequest

pytestmark = pytest.mark.slow  # a tiny model of each of 13 families

# transformers computes these routers' product in fp32 whatever the model's dtype (their logits are fp32)
ALREADY_FP32 = {"deepseek_v3", "kimi_k2", "glm4_moe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe"}
OPTIONS = ScoreOptions(temperature=1.0)


def _older(name: str) -> bool:
    need, have = adapter_for(name).min_transformers, hf_routing.transformers_version()
    return need is not None and hf_routing._release(have) < hf_routing._release(need)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(f, id=f.name, marks=pytest.mark.skipif(_older(f.name), reason="transformers too old"))
        for f in FAMILIES
    ],
)
def family(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param.name))


def _batch() -> list[ScoreRequest]:
    rng = np.random.default_rng(4)
    return [ScoreRequest(i, i, rng.integers(2, 256, 8 + 3 * i), prompt_len=3 + i) for i in range(3)]


def _same(a, b) -> bool:
    return all(np.array_equal(x.logprob, y.logprob) and np.array_equal(x.experts, y.experts) for x, y in zip(a, b))


def _linear(router: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's own weight and bias as loaded (Hunyuan's sit in its `wg` linear)."""
    linear = getattr(router, "wg", router)
    bias = getattr(linear, "bias", None)
    return linear.weight.detach().clone(), None if bias is None else bias.detach().clone()


def test_fp32_router_is_the_familys_router_computed_in_fp32_by_hand(family):
    spec, path = family
    engine = training_engine("hf", load_model_info(path), EngineConfig(dtype="bf16"))
    style = adapter_for(spec.name).style
    routers = [m for m in engine.hf.modules() if type(m).__name__ == spec.router_class]
    loaded = [_linear(r) for r in routers]
    own_dtypes = []  # the bf16 model's own router: its output dtypes
    handles = [
        r.register_forward_hook(lambda _m, _i, out: own_dtypes.append(out[style.weights_at].dtype)) for r in routers
    ]
    plain = engine.score(_batch(), OPTIONS)
    for handle in handles:
        handle.remove()
    assert engine.reconfigure({"router_dtype": "fp32"}) and engine.describe()["router_dtype"] == "fp32"
    calls = []  # (router, its bf16 input, its output)
    for index, router in enumerate(routers):
        router.register_forward_pre_hook(lambda _m, args, i=index: calls.append([i, args[0].detach()]), prepend=True)
        router.register_forward_hook(lambda _m, _i, out: calls[-1].append(out))
    switched = engine.score(_batch(), OPTIONS)
    assert len(calls) == len(routers)
    logits_at = 1 if spec.select == "llama4" else 0
    for index, hidden, output in calls:
        weight, bias = loaded[index]
        assert hidden.dtype == torch.bfloat16  # the hidden states as the bf16 model gives them
        by_hand = torch.nn.functional.linear(
            hidden.reshape(-1, weight.shape[1]).float(), weight.float(), None if bias is None else bias.float()
        )
        assert output[logits_at].dtype == torch.float32
        torch.testing.assert_close(output[logits_at], by_hand, rtol=1e-6, atol=1e-6)
        chosen = style.chosen(routers[index], output)
        assert [set(row) for row in chosen.tolist()] == naive_choice(spec, routers[index], (by_hand, by_hand))
        assert output[style.weights_at].dtype == own_dtypes[0]  # the experts are weighted as the model does
    assert _same(engine.score([_with_replay(r, s) for r, s in zip(_batch(), switched)], OPTIONS), switched)
    assert _same(switched, plain) == (spec.name in ALREADY_FP32)
    assert engine.reconfigure({})
    assert engine.describe()["router_dtype"] == ("fp32" if spec.name in ALREADY_FP32 else "bf16")
    assert _same(engine.score(_batch(), OPTIONS), plain)


def _with_replay(request: ScoreRequest, record) -> ScoreRequest:
    valid = np.ones(len(request), bool)
    return ScoreRequest(
        request.sample_id, request.prompt_id, request.token_ids, request.prompt_len, record.experts, valid
    )


def test_fp32_router_at_fp32_changes_nothing(family):
    spec, path = family
    engine = training_engine("hf", load_model_info(path), EngineConfig(dtype="fp32"))
    plain = engine.score(_batch(), OPTIONS)
    assert engine.reconfigure({"router_dtype": "fp32"})
    switched = engine.score(_batch(), OPTIONS)
    assert _same(switched, plain)
    assert all(np.array_equal(a.router_margin, b.router_margin, equal_nan=True) for a, b in zip(plain, switched))
