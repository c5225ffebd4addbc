"""duplicate_samples: samples of one prompt with identical responses, far more often than chance allows.

Per sample, the rollout's frame gives a digest of its prompt and of its response (sums of two 32-bit
hashes of (position, token id), exact in float64 and additive, so a sample split across chunks or ranges
adds up), its response length and each side's summed log-prob. Samples with equal prompt digests are one
prompt's group (imported runs number prompts their own way; the tokens are what was sampled from).

The chance that another sample of the group repeats a response y is the probability the sampler gave y,
exp of its summed log-probs (taken at the sampling temperature; runs keep no entropies). So a sample of a
group of n has a twin by chance with probability 1 - (1 - p)^(n - 1); a run whose twins far exceed the sum
of those is cloning samples (UniRL PR #208: every sample of a group identical, at temperature 1).
"""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.frames.sequence_sums import OpenSequences, segment_sums

# columns per sample
COLUMNS = ("prompt_h1", "prompt_h2", "prompt_len", "resp_h1", "resp_h2", "resp_len", "lp_ref", "lp_cand")
COLUMNS += ("n_lp_ref", "n_lp_cand")
# Twins must be at least DUPLICATE_MIN samples, and DUPLICATE_FACTOR times the number chance gives plus
# DUPLICATE_Z standard deviations of it (the demo: 8 twins where chance gives 10.7, s.d. 3.1). The factor
# leaves room for top-k/top-p sampling, whose stored log-probs understate the sampler's probabilities.
DUPLICATE_MIN = 4
DUPLICATE_FACTOR = 3.0
DUPLICATE_Z = 5.0
# The same test over the samples whose twin chance is under RARE_CHANCE (long, unlikely responses), so that one
# cloned group among thousands of samples shows: chance gives such twins at most RARE_CHANCE per sample.
RARE_CHANCE = 1e-3
MASK32 = np.uint64(0xFFFFFFFF)


def _hash(position: np.ndarray, token: np.ndarray, a: int, b: int) -> np.ndarray:
    x = position.astype(np.uint64) * np.uint64(a) + token.astype(np.uint64) * np.uint64(b)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return (x & MASK32).astype(np.float64)


class SampleDigests:
    """Fed the frame of the first comparison that holds the rollout (its rows are every side's rows)."""

    def __init__(self, pair_index: int):
        self.pair_index = pair_index
        self.open = OpenSequences()
        self.done: list[np.ndarray] = []  # [COLUMNS + sample id, k] blocks of complete samples

    def update(self, frame) -> None:
        rows = frame.rows
        response = rows.is_response
        h1 = _hash(rows.position, rows.token_id, 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
        h2 = _hash(rows.position, rows.token_id, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
        prompt = ~response
        ok_ref = frame.ref_ok & frame.finite_ref
        ok_cand = frame.cand_ok & frame.finite_cand
        values = np.stack(
            [
                h1 * prompt,
                h2 * prompt,
                prompt.astype(np.float64),
                h1 * response,
                h2 * response,
                response.astype(np.float64),
                np.where(ok_ref, frame.ref.logprob, 0.0),
                np.where(ok_cand, frame.cand.logprob, 0.0),
                ok_ref.astype(np.float64),
                ok_cand.astype(np.float64),
            ]
        )
        self._keep(*self.open.add(rows.segment_ids, segment_sums(values, rows.segment, len(rows.segment_ids))))

    def _keep(self, ids: np.ndarray, sums: np.ndarray) -> None:
        if len(ids):
            self.done.append(np.vstack([sums, ids[None].astype(np.float64)]))

    def merge(self, other: SampleDigests) -> None:
        self.open.merge(other.open)
        self.done += other.done

    def finish(self) -> dict:
        ids, sums = self.open.close(len(COLUMNS))
        blocks = self.done + ([np.vstack([sums, ids[None].astype(np.float64)])] if len(ids) else [])
        table = np.hstack(blocks) if blocks else np.zeros((len(COLUMNS) + 1, 0))
        self.open = OpenSequences()  # closed: the open samples now sit in `done`
        self.done = [table]
        return twins(dict(zip((*COLUMNS, "sample_id"), table)))


def _groups(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group index per sample, samples per group) of the rows of equal keys."""
    _, inverse, counts = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    return inverse, counts


def twins(t: dict[str, np.ndarray]) -> dict:
    """Samples with a twin in their prompt group, and how many chance gives."""
    n = len(t["sample_id"])
    if not n:
        return {"n_samples": 0, "twins": 0, "expected": 0.0, "sd": 0.0, "rare_twins": 0, "rare_expected": 0.0}
    group, group_size = _groups(t["prompt_h1"], t["prompt_h2"], t["prompt_len"])
    response, copies = _groups(group.astype(np.float64), t["resp_h1"], t["resp_h2"], t["resp_len"])
    twin = copies[response] >= 2
    # summed log-prob on each side that scored the whole response; the larger, so chance is not understated
    full = {s: t[f"n_lp_{s}"] == t["resp_len"] for s in ("ref", "cand")}
    summed = np.maximum(np.where(full["ref"], t["lp_ref"], -np.inf), np.where(full["cand"], t["lp_cand"], -np.inf))
    summed = np.where(full["ref"] | full["cand"], summed, 0.0)  # unknown: as likely as can be
    p = np.exp(np.minimum(summed, 0.0))
    others = group_size[group] - 1
    with np.errstate(divide="ignore", invalid="ignore"):  # p = 1: set just below
        chance = -np.expm1(others * np.log1p(-np.minimum(p, 1.0)))
    chance = np.where(p >= 1.0, (others > 0).astype(np.float64), chance)
    first = int(np.flatnonzero(twin)[0]) if twin.any() else None
    rare = chance < RARE_CHANCE
    return {
        "n_samples": n,
        "n_groups": int(len(group_size)),
        "twins": int(twin.sum()),
        "expected": float(chance.sum()),
        "sd": float(math.sqrt(float((chance * (1 - chance)).sum()))),
        "rare_twins": int((twin & rare).sum()),
        "rare_expected": float(chance[rare].sum()),
        "groups_with_twins": int(len(np.unique(group[twin]))),
        "first_sample": None if first is None else int(t["sample_id"][first]),
        "first_response_tokens": None if first is None else int(t["resp_len"][first]),
        "first_probability": None if first is None else float(p[first]),
    }


def too_many_twins(d: dict) -> bool:
    """Far more twins than chance gives: over all samples, or over those whose responses are unlikely."""
    limit = DUPLICATE_FACTOR * d["expected"] + DUPLICATE_Z * max(d["sd"], 1.0)
    rare_limit = DUPLICATE_FACTOR * d["rare_expected"] + DUPLICATE_Z * math.sqrt(d["rare_expected"])
    return d["twins"] >= max(DUPLICATE_MIN, limit) or d["rare_twins"] >= max(DUPLICATE_MIN, rare_limit)
