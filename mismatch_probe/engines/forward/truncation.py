"""Log-probs over a truncated support: what a top-p/top-k sampler draws from, and its log mass.

The support of one position, from its logits at temperature T (`scaled = logits / T`, float32):
- top-k keeps the tokens whose scaled logit is at least the k-th largest (ties at the edge kept, as HF does);
- top-p then keeps, of the distribution renormalised over that set, the tokens whose exclusive cumulative
  probability in descending order is below top_p (HF's and vLLM's rule; the most likely token always stays).
`kept_logmass = logsumexp(scaled[kept]) - logsumexp(scaled) <= 0`, and the processed log-prob of a kept token is
its raw log-prob minus `kept_logmass`; a token outside the support has none (-inf here, null in the table).
The hf engine samples through `TruncationProcessor` (engines/hf/step_capture.py), so the support it writes is the one it sampled from.
"""

from __future__ import annotations

import torch

from mismatch_probe.engines.base import Truncation


def kept_support(scaled: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """`[n, V]` bool: the tokens a sampler with `truncation` may draw, from float32 `scaled` logits `[n, V]`."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    vocab = scaled.shape[-1]
    if 0 < truncation.top_k < vocab:
        kth = torch.topk(scaled, truncation.top_k, dim=-1).values[..., -1:]
        keep = scaled >= kth
    if truncation.top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cumulative = ordered.cumsum(dim=-1)
        exclusive = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
        keep_ordered = exclusive < truncation.top_p
        keep_ordered[..., 0] = True
        keep = keep & torch.zeros_like(keep).scatter(-1, order, keep_ordered)
    return keep


def truncated_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, truncation: Truncation
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprob, top_id, top_logprob, kept_logmass)` in float32, renormalised over each row's own support.
    `logprob` is -inf where the target lies outside the support; the argmax is always inside."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    support = kept_support(scaled, truncation)
    kept = torch.logsumexp(scaled.masked_fill(~support, float("-inf")), dim=-1)
    kept_logmass = (kept - normaliser).clamp(max=0.0)
    top_value, top_id = scaled.max(dim=-1)
    targets = targets.view(-1, 1).to(scaled.device)
    raw = scaled.gather(-1, targets).squeeze(-1) - normaliser
    inside = support.gather(-1, targets).squeeze(-1)
    logprob = torch.where(inside, raw - kept_logmass, torch.full_like(raw, float("-inf")))
    return logprob, top_id, top_value - normaliser - kept_logmass, kept_logmass
