"""decode_path: the rollout (the engine's decode path) against the engine's own prefill of the same tokens (an
engine-prefill score set), above the noise floor and growing along the sequence: a step by position, found by
position_onset's rule. The two sides share weights, kernels' arithmetic for prefill and the tokens, so what grows
with position is the decode path's own: its KV cache, its prefix cache, its decode kernels and graphs."""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.doctor.checks import engine_bugs as C
from mismatch_probe.doctor.stats.onset import ONSET_MIN_TOKENS, ONSET_RATIO, find_onset

SETTINGS = ("kv_cache_dtype", "the prefix cache", "CUDA graphs", "speculative decoding")


def cache_growth(cache: dict | None) -> bool:
    """Samples with prefix-cache hits further from prefill than the others, by position_onset's margins: each group
    at least ONSET_MIN_TOKENS tokens, the lower end of the hits' mean |delta| interval ONSET_RATIO times the upper
    end of the misses'."""
    if not cache:
        return False
    hit, miss = cache["cache_hit"], cache["cache_miss"]
    if min(hit["n_tokens"], miss["n_tokens"]) < ONSET_MIN_TOKENS:
        return False
    return hit["mean_abs_delta_ci95"][0] >= ONSET_RATIO * max(miss["mean_abs_delta_ci95"][1], 0.0)


def decode_path(
    diagnosis, label: str, s: dict, noise_floor: float | None, positions: np.ndarray, cache: dict | None = None
) -> bool:
    """A finding when decode steps away from prefill at some position, or on the samples the prefix cache served,
    and its k3 is above the run's noise floor (the training engine's pass against pass, where the run has one)."""
    k3 = s["k3"] / s["n"] if s.get("n") else None
    if k3 is None or (noise_floor is not None and k3 <= noise_floor):
        return False
    onset = find_onset(positions) if positions.shape[1] > 1 else None
    if onset is None:
        if cache_growth(cache):
            return _cache_finding(diagnosis, label, k3, noise_floor, cache)
        return False
    before, after, ratio = onset["before"], onset["after"], onset["ratio"]
    diagnosis.add(
        C.DECODE_PATH,
        label,
        f"{label}: decode leaves the engine's own prefill from position {onset['onset_position']}: mean |delta| "
        f"{before['mean_abs_delta']:.3g} before it, {after['mean_abs_delta']:.3g} from it on ("
        + (f"{ratio:.1f}x" if math.isfinite(ratio) else "bitwise equal before")
        + f"), k3 {k3:.3g}"
        + (f" against a noise floor of {noise_floor:.3g}" if noise_floor is not None else "")
        + f"; check the server's {', '.join(SETTINGS)}",
        {
            "onset_position": onset["onset_position"],
            "before": before,
            "after": after,
            "ratio": ratio if math.isfinite(ratio) else None,
            "k3_kl": k3,
            "noise_floor": noise_floor,
            "settings": list(SETTINGS),
        },
    )
    return True


def _cache_finding(diagnosis, label: str, k3: float, noise_floor: float | None, cache: dict) -> bool:
    hit, miss = cache["cache_hit"], cache["cache_miss"]
    diagnosis.add(
        C.DECODE_PATH,
        label,
        f"{label}: samples with prefix-cache hits are further from the engine's own prefill than the others: mean "
        f"|delta| {hit['mean_abs_delta']:.3g} over {hit['n_tokens']} tokens against {miss['mean_abs_delta']:.3g} over "
        f"{miss['n_tokens']}, k3 {k3:.3g}"
        + (f" against a noise floor of {noise_floor:.3g}" if noise_floor is not None else "")
        + f"; check the server's {', '.join(SETTINGS)}",
        {"cache": cache, "k3_kl": k3, "noise_floor": noise_floor, "settings": list(SETTINGS)},
    )
    return True
