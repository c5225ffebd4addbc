"""Units of the policy comparison: the --ppo-bounds option, the router row p - 1 across chunks, and the
decomposition's arithmetic against numpy on planted values, chunk cuts and all."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.pair_frame import ChunkRows, ResponseIndex
from mismatch_probe.frames.previous_row import PreviousRow
from mismatch_probe.report.keys.levels import parse_ppo_bounds
from mismatch_probe.report.policy.decomposition import Decomposition


def test_ppo_bounds_parse_as_spelled():
    assert parse_ppo_bounds(["below@0.8", "above@1.20", ("above", "1.27"), "below@0.8"]) == (
        ("below", "0.8"),
        ("above", "1.20"),
        ("above", "1.27"),
    )
    for bad, message in (
        ("sideways@1", "expected below@B or above@B"),
        ("above", "expected below@B or above@B"),
        ("above@x", "'x' is not a number"),
        ("below@0", "must be a finite number > 0"),
    ):
        with pytest.raises(ProbeError, match=message):
            parse_ppo_bounds([bad])


def test_previous_row_carries_across_chunks():
    sample = np.array([0, 0, 0, 1, 1, 1, 1, 2])
    position = np.array([0, 1, 2, 0, 1, 2, 3, 0])
    value = np.arange(8) * 10
    whole_has, (whole,) = PreviousRow().shift(sample, position, value)
    assert whole_has.tolist() == [False, True, True, False, True, True, True, False]
    assert whole[whole_has].tolist() == [0, 10, 30, 40, 50]
    for cut in range(1, 8):  # any cut between chunks gives the same rows p - 1
        carry = PreviousRow()
        has1, (v1,) = carry.shift(sample[:cut], position[:cut], value[:cut])
        has2, (v2,) = carry.shift(sample[cut:], position[cut:], value[cut:])
        has = np.concatenate([has1, has2])
        assert has.tolist() == whole_has.tolist()
        assert np.concatenate([v1, v2])[has].tolist() == whole[whole_has].tolist()


class _Tokens:
    """What Decomposition reads of PolicyTokens: the factors, the chunk's rows and each token's sequence."""

    def __init__(self, sample, a, s, b):
        self.frame = type("Frame", (), {})()
        is_response = np.ones(len(sample), dtype=bool)
        keys = {"sample_id": sample, "position": np.arange(len(sample)), "token_id": sample, "is_response": is_response}
        chunk = type("Chunk", (), keys)
        self.frame.rows = ChunkRows.of(chunk, ResponseIndex(), False)
        self.segment, self.a, self.s, self.b = self.frame.rows.segment, a, s, b


def test_decomposition_against_numpy_and_the_variance_identity():
    rng = np.random.default_rng(3)
    n = 2000
    sample = np.sort(rng.integers(0, 150, n)).astype(np.uint32)
    a, s, b = rng.normal(0, 0.05, n), rng.normal(0.01, 0.2, n), rng.normal(0, 0.03, n)
    s[:20] = np.log(5.5)  # a few tokens beyond every default bound and cap
    acc = Decomposition(tis_caps=("2", "5"))
    for cut in np.split(np.arange(n), [500, 501, 1300]):  # chunks that cut sequences
        acc.update(_Tokens(sample[cut], a[cut], s[cut], b[cut]))
    got = acc.finish(has_natural=True)
    t = a + s
    k3 = lambda x: np.mean(np.expm1(x) - x)  # noqa: E731
    want = {
        "n_policy_tokens": n,
        "tid_k3_kl": k3(a),
        "total_k3_kl": k3(t),
        "tid_log_ratio_var": np.var(a),
        "stale_log_ratio_var": np.var(s),
        "tid_stale_log_ratio_cov": np.cov(a, s, bias=True)[0, 1],
        "total_log_ratio_var": np.var(t),
        "ppo_ratio_below_fraction@0.8": np.mean(np.exp(s) < 0.8),
        "ppo_ratio_above_fraction@1.2": np.mean(np.exp(s) > 1.2),
        "ppo_ratio_above_fraction@1.27": np.mean(np.exp(s) > 1.27),
        "total_tis_clip_fraction@2": np.mean(np.exp(t) > 2),
        "total_tis_clip_fraction@5": np.mean(np.exp(t) > 5),
        "replay_bias_k3_kl": k3(b),
        "replay_bias_mean": np.mean(b),
    }
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    split = got["tid_log_ratio_var"] + got["stale_log_ratio_var"] + 2 * got["tid_stale_log_ratio_cov"]
    assert abs(got["total_log_ratio_var"] - split) <= 1e-12
    low, high = got["total_k3_kl_ci95"]
    assert low < got["total_k3_kl"] < high
    assert Decomposition().finish(has_natural=False)["replay_bias_k3_kl"] is None


@pytest.mark.parametrize("cuts", [[], [2], [3], [1, 4]])
def test_routing_split_judges_token_p_by_routing_row_p_minus_1(cuts):
    """One sequence, prompt of 2 then 4 response tokens; one layer, top-1. The candidate's route differs only on
    row 3. Token 4 is scored by the forward of row 3, so it alone is `routing_diff`; token 3 (its own row
    differs, but it was scored by row 2) is `routing_same`. Judged on row p, the split would be the reverse."""
    from frames import cut, metrics, side_chunk

    from mismatch_probe.schema import RoutingShape

    shape = RoutingShape(num_layers=1, top_k=1, num_experts=4)
    response = [False, False, True, True, True, True]
    ref_lp = np.log([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    cand_lp = np.log([0.5, 0.5, 0.5, 0.4, 0.25, 0.5])  # k3 differs on tokens 3 and 4
    experts = np.zeros((6, 1, 1), dtype=np.uint8)
    moved = experts.copy()
    moved[3] = 1
    ref = side_chunk([0] * 6, ref_lp, is_response=response, experts=experts)
    cand = side_chunk([0] * 6, cand_lp, is_response=response, experts=moved)
    got = metrics(cut(ref, cuts), cut(cand, cuts), shape=shape)
    k3 = lambda p, q: q / p - 1 - np.log(q / p)  # noqa: E731
    assert got["n_tokens@routing_diff"] == 1 and got["n_tokens@routing_same"] == 3
    assert got["k3_kl@routing_diff"] == pytest.approx(k3(0.5, 0.25), rel=1e-6)
    assert got["k3_kl@routing_same"] == pytest.approx((k3(0.5, 0.4) + 0 + 0) / 3, rel=1e-6)
