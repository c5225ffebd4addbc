"""The decode gap split by prefix-cache hit: the rollout against the engine's own prefill (an engine-prefill set),
over samples whose prompt the engine's prefix cache served in part (`cached_tokens` > 0) and over the others.
A stale prefix cache (KV kept across a weight update, NeMo-RL#4018, #3152) shows as hits further from prefill
than misses. Read part by part from the rollout's `cached_tokens` column (where the engine said it) and the
prefill set's log-probs, whose part files hold the same rows."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.doctor.stats.onset import _level
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.parts import part_files
from mismatch_probe.schema import CACHED_TOKENS

GROUPS = ((1, "cache_hit"), (0, "cache_miss"))


def cache_split(run: Run, prefill: str) -> dict | None:
    """{cache_hit, cache_miss: {n_samples, n_tokens, k3_kl, mean_abs_delta, ci95 of the mean |delta|}}; None where
    the rollout records no cached_tokens (an engine that does not say, an older run)."""
    sums = np.zeros((2, 4))  # [miss, hit] x [tokens, sum k3, sum |delta|, sum delta^2]
    samples: list[set] = [set(), set()]
    for part in part_files(run.rollout_dir):
        other = run.side_dir(prefill) / part.name
        if CACHED_TOKENS not in pq.read_schema(part).names or not other.is_file():
            return None
        rollout = pq.read_table(part, columns=["sample_id", "is_response", "logprob", CACHED_TOKENS])
        cand = pq.read_table(other, columns=["logprob"]).column("logprob").to_numpy(zero_copy_only=False)
        delta = cand.astype(np.float64) - rollout.column("logprob").to_numpy(zero_copy_only=False).astype(np.float64)
        cached = rollout.column(CACHED_TOKENS)
        known = cached.is_valid().to_numpy(zero_copy_only=False)
        hit = cached.fill_null(0).to_numpy(zero_copy_only=False) > 0
        keep = rollout.column("is_response").to_numpy(zero_copy_only=False) & known & np.isfinite(delta)
        ids = rollout.column("sample_id").to_numpy(zero_copy_only=False)
        for group in (0, 1):
            rows = keep & (hit == bool(group))
            d = delta[rows]
            sums[group] += [rows.sum(), np.sum(np.expm1(d) - d), np.abs(d).sum(), np.sum(d * d)]
            samples[group].update(np.unique(ids[rows]).tolist())
    if not sums[:, 0].any():
        return None
    out = {}
    for group, name in GROUPS:
        n, k3, total, squares = sums[group]
        level = _level(n, total, squares) if n else None
        out[name] = {
            "n_samples": len(samples[group]),
            "n_tokens": int(n),
            "k3_kl": k3 / n if n else None,
            "mean_abs_delta": None if level is None else level["mean_abs_delta"],
            "mean_abs_delta_ci95": None if level is None else level["ci95"],
        }
    return out
