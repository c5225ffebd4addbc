"""decode_share: how much of the rollout's k3 against a training engine the inference engine's own prefill
removes, `1 - k3(prefill, training) / k3(rollout, training)`, with the paired-bootstrap interval of routing_share
(attribution.paired_ratio); and decode_gap: k3 of the rollout (the engine's decode path) against its prefill.

A share near 1 puts the mismatch in the engine's decode path (a KV-cache dtype, a stale prefix cache, a decode
kernel, speculative decoding): a serving setting. A share near 0 puts it in the kernels both of the engine's paths
share, against the trainer's: a training-side change."""

from __future__ import annotations

from mismatch_probe.doctor.stats.decode_cache import cache_split
from mismatch_probe.frames.bootstrap import ci_key, interval
from mismatch_probe.report import numbers
from mismatch_probe.rundir.layout import PREFILL, ROLLOUT, TRAINING, Run

DECODE_SHARE, DECODE_GAP = "decode_share", "decode_gap"
K3 = "k3_kl"


def onset_position(profile: dict | None) -> int | None:
    """Where |delta| by position steps up (the doctor's position_onset rule); None without a step."""
    onset = (profile or {}).get("onset")
    return None if onset is None else onset["onset_position"]


def decode_entries(run: Run, compared, chosen: set[str], paired_ratio) -> dict[str, list[dict]]:
    """{decode_share: [...], decode_gap: [...]} where the run has an engine-prefill set; {} otherwise."""
    by_pair = {(c.ref.side, c.cand.side): c for c in compared}
    prefills = sorted({c.cand.side for c in compared if c.cand.role == PREFILL and c.ref.side == ROLLOUT})
    if not prefills:
        return {}
    gaps, shares = [], []
    for prefill in prefills:
        gap = by_pair[ROLLOUT, prefill]
        gaps.append(
            {
                "reference": ROLLOUT,
                "candidate": prefill,
                "engine": gap.cand.engine,
                "n_tokens": gap.metrics.get("n_tokens"),
                K3: gap.k3,
                ci_key(K3): gap.k3_ci,
                "onset_position": onset_position(gap.profile),
                "cache_split": cache_split(run, prefill),
            }
        )
        for (ref, cand), matched in by_pair.items():
            if ref != prefill or matched.cand.role != TRAINING or cand not in chosen:
                continue
            plain = by_pair.get((ROLLOUT, cand))
            if plain is None:
                continue
            ratio, resampled = paired_ratio(matched, plain)
            shares.append(
                {
                    "reference": ROLLOUT,
                    "prefill": prefill,
                    "training": cand,
                    "engine": matched.cand.engine,
                    "dtype": matched.cand.dtype,
                    "replay": matched.cand.replay,
                    "k3_kl_rollout": plain.k3,
                    "k3_kl_rollout_ci95": plain.k3_ci,
                    "k3_kl_prefill": matched.k3,
                    "k3_kl_prefill_ci95": matched.k3_ci,
                    "share": None if ratio is None else 1.0 - ratio,
                    "share_ci95": None if resampled is None else interval(1.0 - resampled),
                }
            )
    return {DECODE_GAP: gaps, DECODE_SHARE: shares}


def decode_headlines(entries: dict) -> list[str]:
    out = []
    for e in entries.get(DECODE_GAP) or []:
        out.append(
            f"The {e['engine']} engine's decode path against its own prefill ({e['candidate']}): k3 "
            f"{numbers.with_interval(e[K3], e[ci_key(K3)])} over {e['n_tokens']} tokens"
            + (
                f"; decode leaves prefill from position {e['onset_position']}."
                if e.get("onset_position") is not None
                else "."
            )
            + _split_words(e.get("cache_split"))
        )
    for e in entries.get(DECODE_SHARE) or []:
        out.append(
            f"The engine's decode path explains {numbers.percent(e['share'], e['share_ci95'])} of k3 between the "
            f"rollout and {e['engine']} training at {e['dtype']}: k3 "
            f"{numbers.with_interval(e['k3_kl_rollout'], e['k3_kl_rollout_ci95'])} from the rollout, "
            f"{numbers.with_interval(e['k3_kl_prefill'], e['k3_kl_prefill_ci95'])} from the engine's prefill "
            f"({e['prefill']})."
        )
    return out


def _split_words(split: dict | None) -> str:
    if not split or not all(split[g]["n_tokens"] for g in ("cache_hit", "cache_miss")):
        return ""
    hit, miss = split["cache_hit"], split["cache_miss"]
    return (
        f" Samples with prefix-cache hits: k3 {numbers.value(hit[K3])} over {hit['n_tokens']} tokens; "
        f"without: {numbers.value(miss[K3])} over {miss['n_tokens']}."
    )
