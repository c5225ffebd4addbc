"""The synthetic run writer: valid expert sets, length distributions, and the benchmark CLI around it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.testing.synthetic import SyntheticSpec, _distinct_experts, response_lengths

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("experts,dtype", [(128, np.uint8), (300, np.uint16)])
def test_expert_ids_are_distinct_within_each_slot_and_cover_all_experts(experts, dtype):
    spec = SyntheticSpec(num_layers=5, top_k=8, num_experts=experts)
    ids = _distinct_experts(np.random.default_rng(1), 4000, spec)
    assert ids.shape == (4000, 5, 8) and ids.dtype == dtype
    ordered = np.sort(ids.astype(np.int64), axis=-1)
    assert (np.diff(ordered, axis=-1) > 0).all()
    assert set(np.unique(ids)) == set(range(experts))


def test_lognormal_lengths_stay_in_range_with_a_long_tail():
    spec = SyntheticSpec(n_samples=20_000, response_len=(100, 10_000), response_dist="lognormal")
    lengths = response_lengths(np.random.default_rng(0), spec)
    assert lengths.min() >= 100 and lengths.max() <= 10_000
    assert 900 < np.median(lengths) < 1100  # the range's geometric mean
    assert lengths.mean() > np.median(lengths) * 1.1  # right-skewed


def test_unknown_length_distribution_is_refused():
    with pytest.raises(ValueError, match="response_dist: 'zipf'"):
        response_lengths(np.random.default_rng(0), SyntheticSpec(response_dist="zipf"))


def test_make_synthetic_run_cli(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "make_synthetic_run.py"),
        str(out),
        "--tokens",
        "3000",
        "--layers",
        "3",
        "--top-k",
        "2",
        "--experts",
        "8",
        "--response-len",
        "50,200",
        "--prompt-len",
        "4,8",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = pq.read_table(out / "rollout")
    responses = int(table.column("is_response").to_numpy(zero_copy_only=False).sum())
    assert 2000 < responses < 4000
    assert set(np.diff(table.column("experts").combine_chunks().offsets.to_numpy()).tolist()) <= {0, 3 * 2}
    assert f"{responses:,} response tokens" in result.stdout
    assert (out / "scores" / "synthetic-0" / "manifest.json").is_file()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "exists (use --force to replace it)" in again.stderr
