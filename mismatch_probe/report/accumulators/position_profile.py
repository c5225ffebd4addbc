"""Mean |delta| by absolute position, and the position from which it steps up (the doctor's position_onset
rule, doctor/stats/onset.py): for the rollout against the engine's own prefill and against each training set of
a run that has an engine-prefill set, where decode leaving prefill from a fixed position (an fp8 KV cache, a
decode kernel whose tiles change with the context length) shows as a step."""

from __future__ import annotations

import numpy as np

from mismatch_probe.doctor.stats.onset import PositionLevels, find_onset
from mismatch_probe.vocab import POSITION_PROFILE as PROFILE


class PositionProfile(PositionLevels):
    def __init__(self, against_prefill: bool = False):
        super().__init__()
        self.against_prefill = against_prefill  # the candidate is the engine's own prefill: decode against it

    def finish(self) -> dict:
        n, total, _ = self.sums
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = np.where(n > 0, total / n, np.nan)
        onset = find_onset(self.sums) if self.sums.shape[1] > 1 else None
        return {
            PROFILE: {
                "n_tokens": n.astype(np.int64).tolist(),
                "mean_abs_delta": [None if np.isnan(v) else float(v) for v in mean],
                "onset": onset,
                "against_prefill": self.against_prefill,
            }
        }
