"""The training-engine contract (engines/forward/scoring.py), run unchanged against every training engine.

Reference log-probs and routing come from a second, naive implementation: one unpadded transformers
forward per sequence with a full-vocabulary log-softmax and a hook on each router.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from mismatch_probe.engines import PREFILL_ENGINES, TRAINING, training_engine
from mismatch_probe.engines.base import EngineConfig, ScoreOptions
from mismatch_probe.engines.forward.scoring import is_writer_rank
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import load_model_info
from mismatch_probe.rundir.records import ScoreRequest

pytest.importorskip("megatron.core")

ENGINES = sorted(set(TRAINING) - set(PREFILL_ENGINES))  # an engine's prefill is tested in test_engine_prefill.py
VOCAB, EXPERTS, LAYERS, TOP_K = 96, 8, 2, 2  # the tiny_moe fixture (conftest.py): MoE layers 0 and 2


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_moe):
    # A small LM-head chunk, so that chunking is exercised by every case.
    return training_engine(
        request.param, load_model_info(tiny_moe), EngineConfig(dtype="fp32", engine_args={"logprob_chunk": 7})
    )


@pytest.fixture(scope="module")
def reference(tiny_moe):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    routes: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))

    def run(request: ScoreRequest, temperature: float):
        """Log-prob of every position after the first (NaN at 0) and `[n, L, k]` experts."""
        routes.clear()
        ids = torch.as_tensor(request.token_ids)[None]
        with torch.no_grad():
            logits = model(ids).logits[0].float() / temperature
        logprob = np.full(len(request), np.nan, dtype=np.float32)
        logprob[1:] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
        return logprob, np.stack([r.numpy() for r in routes], axis=1)

    return run


def _requests(lengths, prompt_lens, seed=0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [
        ScoreRequest(i, 100 + i, rng.integers(2, VOCAB, n), p) for i, (n, p) in enumerate(zip(lengths, prompt_lens))
    ]


def _with_replay(request: ScoreRequest, experts: np.ndarray, valid: np.ndarray | None = None) -> ScoreRequest:
    valid = np.ones(len(request), bool) if valid is None else valid
    return ScoreRequest(request.sample_id, request.prompt_id, request.token_ids, request.prompt_len, experts, valid)


def _shifted(experts: np.ndarray) -> np.ndarray:
    """Other experts than the given ones at every (position, layer), still distinct within a row."""
    return (experts.astype(np.int64) + 1) % EXPERTS


def _last_unrouted(n: int) -> np.ndarray:
    """What every inference engine reports: routing for all positions but the never-forwarded last one."""
    return np.arange(n) < n - 1


def test_records_match_naive_forward_with_unequal_lengths(engine, reference):
    batch = _requests([11, 4, 8], [3, 2, 5])
    records = engine.score(batch, ScoreOptions(temperature=0.7))
    assert [(r.sample_id, r.prompt_id, r.prompt_len) for r in records] == [(0, 100, 3), (1, 101, 2), (2, 102, 5)]
    for record, request in zip(records, batch):
        n, p = len(request), request.prompt_len
        ref_logprob, ref_experts = reference(request, 0.7)
        np.testing.assert_array_equal(record.token_ids, request.token_ids)
        assert record.logprob_valid.tolist() == [False] * p + [True] * (n - p)
        assert record.logprob.dtype == np.float32 and record.top_logprob.dtype == np.float32
        assert not record.logprob[:p].any() and not record.top_token_id[:p].any() and not record.top_logprob[:p].any()
        np.testing.assert_allclose(record.logprob[p:], ref_logprob[p:], atol=1e-4, rtol=0)
        assert (record.top_logprob[p:] >= record.logprob[p:] - 1e-6).all()
        np.testing.assert_array_equal(record.experts, ref_experts)
        assert record.experts.shape == (n, LAYERS, TOP_K) and record.experts_valid.all()


def test_empty_prompt_scores_from_position_one(engine, reference):
    [request] = _requests([7], [0], seed=1)
    [record] = engine.score([request], ScoreOptions(temperature=1.0))
    ref_logprob, _ = reference(request, 1.0)
    assert record.logprob_valid.tolist() == [False] + [True] * 6  # position 0 has nothing before it
    assert record.logprob[0] == 0 and record.top_token_id[0] == 0
    np.testing.assert_allclose(record.logprob[1:], ref_logprob[1:], atol=1e-4, rtol=0)


def test_nothing_to_score_and_empty_batch(engine):
    [request] = _requests([4], [4], seed=2)  # all prompt
    [record] = engine.score([request], ScoreOptions(temperature=1.0))
    assert not record.logprob_valid.any() and not record.logprob.any()
    assert record.experts.shape == (4, LAYERS, TOP_K)
    assert engine.score([], ScoreOptions(temperature=1.0)) == []


def test_deterministic_and_padding_invariant(engine):
    batch = _requests([10, 3, 7], [2, 1, 0], seed=3)
    first = engine.score(batch, ScoreOptions(temperature=1.0))
    again = engine.score(batch, ScoreOptions(temperature=1.0))
    padded = engine.score(batch, ScoreOptions(temperature=1.0, extra_padding=6))
    for a, b, c, request in zip(first, again, padded, batch):
        np.testing.assert_array_equal(a.logprob, b.logprob)  # bitwise: same engine, same batch
        np.testing.assert_array_equal(a.experts, b.experts)
        alone = engine.score([request], ScoreOptions(temperature=1.0))[0]
        for other in (c, alone):
            np.testing.assert_allclose(other.logprob, a.logprob, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(other.logprob_valid, a.logprob_valid)
            np.testing.assert_array_equal(other.experts, a.experts)


def test_self_replay_reproduces_free_scoring(engine):
    batch = _requests([9, 6], [3, 0], seed=4)
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    replayed = engine.score(
        [_with_replay(r, f.experts, _last_unrouted(len(r))) for r, f in zip(batch, free)],
        ScoreOptions(temperature=1.0, extra_padding=2),
    )
    for f, r in zip(free, replayed):
        np.testing.assert_array_equal(r.experts, f.experts)
        # the replayed batch is padded differently: another GEMM shape, fp32 summation noise of ~2e-6 on some
        # CPUs, the tolerance test_deterministic_and_padding_invariant allows a padded batch
        np.testing.assert_allclose(r.logprob, f.logprob, atol=1e-5, rtol=0)


def test_replay_forces_the_given_experts(engine):
    batch = _requests([10, 5], [4, 2], seed=5)
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    forced = [_with_replay(r, _shifted(f.experts), _last_unrouted(len(r))) for r, f in zip(batch, free)]
    records = engine.score(forced, ScoreOptions(temperature=1.0, extra_padding=3))
    for f, r, request in zip(free, records, forced):
        np.testing.assert_array_equal(r.experts[:-1], request.replay_experts[:-1])
        # The last position has no replay experts: the router chooses freely, k distinct valid ids.
        assert all(len(set(ids.tolist())) == TOP_K and max(ids) < EXPERTS for ids in r.experts[-1])
        assert r.experts_valid.all()
        assert np.abs(r.logprob - f.logprob)[f.logprob_valid].max() > 1e-3


def test_replay_is_per_request_and_unreported_prefix_routes_freely(engine):
    batch = _requests([8, 9], [2, 3], seed=6)
    free = engine.score(batch, ScoreOptions(temperature=1.0))
    valid = _last_unrouted(9)
    valid[:4] = False  # positions the rollout did not report
    mixed = [batch[0], _with_replay(batch[1], _shifted(free[1].experts), valid)]
    plain, replayed = engine.score(mixed, ScoreOptions(temperature=1.0))
    np.testing.assert_array_equal(plain.experts, free[0].experts)  # no replay experts: not replayed
    np.testing.assert_allclose(plain.logprob, free[0].logprob, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(replayed.experts[:4], free[1].experts[:4])  # causal: nothing forced yet
    np.testing.assert_array_equal(replayed.experts[4:8], _shifted(free[1].experts)[4:8])


def test_replay_without_any_experts_is_refused(engine):
    [request] = _requests([6], [2], seed=7)
    unrouted = _with_replay(request, np.zeros((6, LAYERS, TOP_K), np.uint8), np.zeros(6, bool))
    with pytest.raises(ProbeError) as err:
        engine.score([request, unrouted], ScoreOptions(temperature=1.0))
    assert str(err.value) == (
        "sample 0: replay asked for, but the rollout has routed experts for none of its 6 positions "
        "(the inference engine returned no routing; rescore without --replay r3)"
    )


@pytest.mark.parametrize(
    "experts, valid, message",
    [
        (np.full((6, LAYERS, TOP_K), EXPERTS), None, f"sample 0: replay expert id {EXPERTS} >= num_experts {EXPERTS}"),
        (np.full((6, LAYERS, TOP_K), -1), None, "sample 0: replay expert id -1 < 0"),
        (
            np.zeros((5, LAYERS, TOP_K)),
            None,
            f"sample 0: replay experts have shape (5, 2, 2), expected (6, {LAYERS}, {TOP_K})",
        ),
        (np.zeros((6, LAYERS, TOP_K)), np.ones(5, bool), "sample 0: replay validity has shape (5,), expected (6,)"),
    ],
)
def test_bad_replay_experts_are_refused(engine, experts, valid, message):
    [request] = _requests([6], [2], seed=8)
    bad = ScoreRequest(0, 0, request.token_ids, 2, experts, np.ones(6, bool) if valid is None else valid)
    with pytest.raises(ProbeError) as err:
        engine.score([bad], ScoreOptions(temperature=1.0))
    assert str(err.value) == message


def test_writer_is_rank_zero(engine, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert is_writer_rank()
    if not torch.distributed.is_initialized():  # the megatron engine runs a one-process group
        monkeypatch.setenv("RANK", "1")
        assert not is_writer_rank()


def test_engines_agree_with_each_other(tiny_moe):
    """The same tokens, the same replay: every engine gives the same log-probs and routing in fp32."""
    info = load_model_info(tiny_moe)
    engines = [training_engine(name, info, EngineConfig(dtype="fp32")) for name in ENGINES]
    batch = _requests([12, 5, 9], [4, 0, 2], seed=9)
    base = engines[0].score(batch, ScoreOptions(temperature=0.8))
    forced = [_with_replay(r, _shifted(b.experts), _last_unrouted(len(r))) for r, b in zip(batch, base)]
    for options, requests in ((ScoreOptions(0.8), batch), (ScoreOptions(0.8, extra_padding=2), forced)):
        results = [e.score(requests, options) for e in engines]
        for records in zip(*results):
            for other in records[1:]:
                np.testing.assert_allclose(other.logprob, records[0].logprob, atol=1e-4, rtol=0)
                np.testing.assert_array_equal(other.logprob_valid, records[0].logprob_valid)
                np.testing.assert_array_equal(other.top_token_id, records[0].top_token_id)
                np.testing.assert_array_equal(other.experts, records[0].experts)  # the free last token too
