"""Which log-probs vLLM returns, told by measurement: what the `vllm` (server) and `vllm-offline`
(in-process) engines share.

The probe needs `log_softmax(logits / T)`, vLLM's `processed_logprobs` mode. Neither a server nor the
`LLM` class reports its mode in a form both can read, so each asks one position's top log-probs at T=1
and T=PROBE_TEMPERATURE and `classify_logprobs_mode` tells the mode from how their gaps scale.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.engines.base import SamplingParams

PROBE_TEMPERATURE = 0.5  # second temperature of the log-prob mode measurement
PROBE_TOP = 5  # log-probs per position in that measurement


RENORMALISED_WARNING = (
    "vLLM's processed log-probs are renormalised over the top-k/top-p set; the probe scores "
    "log_softmax(logits / T) without it, so with --top-p < 1 or --top-k the two sides differ by "
    "log(kept mass) even with identical logits"
)


def renormalised(params: SamplingParams) -> bool:
    """Whether vLLM's processed log-probs are renormalised over a top-k/top-p set for these params."""
    return params.temperature > 0 and (params.top_p < 1.0 or params.top_k > 0)


def classify_logprobs_mode(at_one: dict[str, float], at_t: dict[str, float], t: float) -> str | None:
    """Which `--logprobs-mode` produced these top log-probs of one position, asked at T=1 and T=t.

    Raw modes ignore temperature; processed modes divide logits by T, so the gap between two
    tokens' values grows by 1/T. Log-probs (unlike logits) are <= 0 with total mass <= 1.
    None when the distribution is too flat to tell.
    """
    common = sorted(set(at_one) & set(at_t))
    if len(common) < 2:
        return None
    a = np.array([at_one[k] for k in common])
    b = np.array([at_t[k] for k in common])
    spread = a.max() - a.min()
    if spread < 1e-2:
        return None
    ratio = (b.max() - b.min()) / spread
    kind = "logprobs" if all(_looks_like_logprobs(v) for v in (a, b)) else "logits"
    if abs(ratio - 1.0) < 0.05:
        return f"raw_{kind}"
    if abs(ratio - 1.0 / t) < 0.05 / t:
        return f"processed_{kind}"
    return None


def _looks_like_logprobs(values: np.ndarray) -> bool:
    return values.max() <= 1e-4 and float(np.log(np.exp(values).sum())) <= 1e-3
