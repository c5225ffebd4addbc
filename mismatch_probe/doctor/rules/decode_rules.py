"""decode_path: the rollout (the engine's decode path) against the engine's own prefill of the same tokens (an
engine-prefill score set), above the noise floor and growing along the sequence: a step by position, found by
position_onset's rule. The two sides share weights, kernels' arithmetic for prefill and the tokens, so what grows
with position is the decode path's own: its KV cache, its prefix cache, its decode kernels and graphs."""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.doctor.checks import engine_bugs as C
from mismatch_probe.doctor.stats.onset import find_onset

SETTINGS = ("kv_cache_dtype", "the prefix cache", "CUDA graphs", "speculative decoding")


def decode_path(diagnosis, label: str, s: dict, noise_floor: float | None, positions: np.ndarray) -> bool:
    """A finding when decode steps away from prefill at some position and its k3 is above the run's noise floor
    (the training engine's pass against pass, where the run has one)."""
    k3 = s["k3"] / s["n"] if s.get("n") else None
    if k3 is None or (noise_floor is not None and k3 <= noise_floor) or positions.shape[1] < 2:
        return False
    onset = find_onset(positions)
    if onset is None:
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
