"""Synthetic runs of any shape with planted mismatch, for tests and report benchmarks.

Arrays are built for many sequences at once; only the final split into SequenceRecords is per sequence.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mismatch_probe.rundir.layout import MANIFEST, ROLLOUT, SCORES
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest, ScoreManifest, now_iso, package_versions
from mismatch_probe.rundir.parts import write_part
from mismatch_probe.rundir.records import SequenceRecord
from mismatch_probe.schema import SCHEMA_VERSION, RoutingShape, token_schema
from mismatch_probe.vocab import NO_REPLAY, Replay

SYNTHETIC_CONFIG_HASH = "synthetic"
TOP_P = 0.7  # the top-p the manifests of sides with kept_logmass declare (processed log-probs)


@dataclass(frozen=True)
class ScoreSetSpec:
    name: str
    logprob_sigma: float = 0.01  # std of the Gaussian noise added to the rollout log-probs
    route_fraction: float = 0.01  # fraction of (token, layer) slots with one expert swapped
    shuffle_order: bool = False  # reverse each layer's id order (same sets: must count as no difference)
    nonfinite_fraction: float = 0.0  # response log-probs replaced by NaN / -inf
    routing: bool = True  # False: this side has no routing (e.g. vLLM on CPU)
    replay: Replay = NO_REPLAY
    repeat_group: str | None = None
    pass_index: int | None = None
    engine: str = "synthetic"
    dtype: str = "bfloat16"
    role: str | None = None  # the manifest's role (rundir/roles.py): matched, a diagnostic role, or unrecorded
    # `kept_logmass` on this side: the rollout's, off by a little noise (a pass with --sampling rollout); with
    # outside_support_fraction, that share of response tokens sampled outside its support (log-prob null)
    kept_logmass: bool = False
    outside_support_fraction: float = 0.0


@dataclass(frozen=True)
class SyntheticSpec:
    num_layers: int = 4
    top_k: int = 4
    num_experts: int = 16
    n_samples: int = 32
    prompt_len: tuple[int, int] = (4, 16)  # inclusive range, uniform
    response_len: tuple[int, int] = (8, 64)
    # "uniform" over response_len, or "lognormal": median at the range's geometric mean, clipped to the
    # range, the long-tailed shape of RL rollouts.
    response_dist: str = "uniform"
    vocab_size: int = 1000
    seed: int = 0
    samples_per_part: int = 4096
    temperature: float = 1.0
    router_margin: bool = False  # write the optional `router_margin` column on every side with routing
    kept_logmass: bool = False  # the rollout writes `kept_logmass` (a truncated, processed-mode rollout)
    score_sets: tuple[ScoreSetSpec, ...] = field(default_factory=lambda: (ScoreSetSpec(name="synthetic-bf16"),))

    @property
    def shape(self) -> RoutingShape:
        return RoutingShape(num_layers=self.num_layers, top_k=self.top_k, num_experts=self.num_experts)

    @property
    def scoring_temperature(self) -> float:
        return self.temperature or 1.0  # greedy rollouts are scored at T = 1


def _distinct_experts(rng, n: int, spec: SyntheticSpec) -> np.ndarray:
    """[n, layers, k] ids, distinct within each (token, layer): prefixes of random permutations, rotated.

    Every (permutation, rotation) pair is tabulated up front, so each (token, layer) costs one
    random draw and one k-byte gather: paper-shape runs (48 x 8 ids per token) need ~1 ns per id.
    """
    experts, k = spec.num_experts, spec.top_k
    prefixes = np.argsort(rng.random((256, experts)), axis=1)[:, :k]
    rotations = np.arange(experts)[None, :, None]
    table = ((prefixes[:, None, :] + rotations) % experts).astype(spec.shape.id_dtype).reshape(-1, k)
    # Rows as opaque k-id records, so the gather moves whole rows instead of k separate ids.
    rows = table.view(np.dtype((np.void, k * table.itemsize))).reshape(-1)
    pick = rng.integers(0, len(rows), size=(n, spec.num_layers), dtype=np.uint32)
    return rows[pick].view(table.dtype).reshape(n, spec.num_layers, k)


def _perturb_routing(rng, experts: np.ndarray, fraction: float, num_experts: int) -> np.ndarray:
    """Swap one expert of a `fraction` of (token, layer) slots for an expert not already in the slot."""
    out = experts.copy()
    n, layers, k = out.shape
    tok, layer = np.nonzero(rng.random((n, layers)) < fraction)
    slot = rng.integers(0, k, size=len(tok))
    current = out[tok, layer]  # [m, k]
    new = rng.integers(0, num_experts, size=len(tok))
    for _ in range(64):  # redraw the few candidates that collide with the slot's own experts
        clash = (current == new[:, None]).any(axis=1)
        if not clash.any():
            break
        new[clash] = rng.integers(0, num_experts, size=int(clash.sum()))
    out[tok, layer, slot] = new.astype(out.dtype)
    return out


def _router_margins(rng, n: int, spec: SyntheticSpec) -> np.ndarray:
    """[n, layers] float32 margins, log-uniform over 1e-7..30 (every bin of the report's histogram), some exact ties."""
    margins = 10.0 ** rng.uniform(-7.0, 1.5, size=(n, spec.num_layers))
    margins[rng.random(margins.shape) < 0.02] = 0.0
    return margins.astype(np.float32)


def _records(sample_ids, prompt_lens, lengths, arrays: dict) -> list[SequenceRecord]:
    bounds = np.cumsum(lengths)[:-1]
    split = {
        key: (np.split(value, bounds) if value is not None else [None] * len(lengths)) for key, value in arrays.items()
    }
    return [
        SequenceRecord(
            sample_id=int(sid),
            prompt_id=int(sid),
            prompt_len=int(plen),
            **{key: split[key][i] for key in arrays},
        )
        for i, (sid, plen) in enumerate(zip(sample_ids, prompt_lens))
    ]


def _rollout_manifest(spec: SyntheticSpec) -> RolloutManifest:
    return RolloutManifest(
        schema_version=SCHEMA_VERSION,
        created_at=now_iso(),
        status=COMPLETE,
        model="synthetic",
        config_hash=SYNTHETIC_CONFIG_HASH,
        num_layers=spec.num_layers,
        top_k=spec.top_k,
        num_experts=spec.num_experts,
        moe_layer_indices=list(range(spec.num_layers)),
        engine="synthetic",
        dtype="bfloat16",
        sampling={"temperature": spec.temperature, "top_p": 1.0, "top_k": -1}
        | ({"top_p": TOP_P, "top_k": 0, "logprobs_mode": "processed"} if spec.kept_logmass else {}),
        scoring_temperature=spec.scoring_temperature,
        seed=spec.seed,
        versions=package_versions(),
    )


def _score_manifest(s: ScoreSetSpec, spec: SyntheticSpec) -> ScoreManifest:
    return ScoreManifest(
        schema_version=SCHEMA_VERSION,
        name=s.name,
        role=s.role,
        created_at=now_iso(),
        status=COMPLETE,
        engine=s.engine,
        dtype=s.dtype,
        replay=s.replay,
        temperature=spec.scoring_temperature,
        repeat_group=s.repeat_group,
        pass_index=s.pass_index,
        sampling={"temperature": spec.scoring_temperature, "top_p": TOP_P, "top_k": 0, "logprobs_mode": "processed"}
        if s.kept_logmass
        else None,
        model="synthetic",
        config_hash=SYNTHETIC_CONFIG_HASH,
        versions=package_versions(),
    )


def response_lengths(rng, spec: SyntheticSpec) -> np.ndarray:
    low, high = spec.response_len
    if spec.response_dist == "uniform":
        return rng.integers(low, high + 1, size=spec.n_samples)
    if spec.response_dist == "lognormal":
        # The range spans +-2.5 sigma around the median.
        median, sigma = np.sqrt(low * high), max(np.log(high / low) / 5, 1e-9)
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=spec.n_samples)), low, high).astype(np.int64)
    raise ValueError(f"response_dist: {spec.response_dist!r}, expected 'uniform' or 'lognormal'")


def write_synthetic_run(root, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shape = spec.shape
    rng = np.random.default_rng(spec.seed)
    prompt_lens = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, size=spec.n_samples)
    resp_lens = response_lengths(rng, spec)
    # Parquet encoding releases the GIL: part i is written while part i+1 is drawn, at most two in memory.
    with ThreadPoolExecutor(max_workers=1 + len(spec.score_sets)) as pool:
        pending: list = []
        for first in range(0, spec.n_samples, spec.samples_per_part):
            ids = np.arange(first, min(first + spec.samples_per_part, spec.n_samples))
            part_rng = np.random.default_rng([spec.seed, first])
            writes = _write_part_sides(root, shape, spec, part_rng, ids, prompt_lens[ids], resp_lens[ids], pool)
            for future in pending:
                future.result()
            pending = writes
        for future in pending:
            future.result()
    _rollout_manifest(spec).save(root / MANIFEST)
    for s in spec.score_sets:
        _score_manifest(s, spec).save(root / SCORES / s.name / MANIFEST)
    return root


def _kept_logmass(rng, response: np.ndarray) -> np.ndarray:
    """Per row, the log of a top-p support's mass: 0 on a third of the response rows (the support is the whole
    vocabulary), small negative values elsewhere; 0 on prompt rows (written null there)."""
    kept = -rng.exponential(0.1, size=len(response)) * (rng.random(len(response)) < 0.67)
    return np.where(response, kept, 0.0).astype(np.float32)


def _write_part_sides(root, shape, spec, rng, ids, prompt_lens, resp_lens, pool) -> list:
    def schema(kept: bool):
        return token_schema(shape, with_router_margin=spec.router_margin, with_kept_logmass=kept)

    lengths = prompt_lens + resp_lens
    n = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = np.arange(n) - starts
    response = pos >= np.repeat(prompt_lens, lengths)
    last = pos == np.repeat(lengths - 1, lengths)
    tokens = rng.integers(0, spec.vocab_size, size=n)
    # Confident sampled tokens, as trained models give: most log-probs near 0.
    logprob = np.minimum(-rng.exponential(0.3, size=n), 0.0).astype(np.float32)
    top = np.where(rng.random(n) < 0.9, tokens, rng.integers(0, spec.vocab_size, size=n))
    experts = _distinct_experts(rng, n, spec) if shape.is_moe else None
    rollout = {
        "token_ids": tokens,
        "logprob": logprob,
        "logprob_valid": response,
        "top_token_id": top,
        "top_logprob": logprob,
        # The last sampled token is never forwarded by the inference engine: no routing there.
        "experts": experts,
        "experts_valid": ~last if shape.is_moe else None,
    }
    margins = _router_margins(rng, n, spec) if spec.router_margin and shape.is_moe else None
    rollout["router_margin"] = margins
    kept = _kept_logmass(rng, response) if spec.kept_logmass else None
    rollout["kept_logmass"] = kept
    records = _records(ids, prompt_lens, lengths, rollout)
    writes = [pool.submit(write_part, root / ROLLOUT, records, schema(spec.kept_logmass), shape)]
    for s in spec.score_sets:
        cand_lp = np.minimum(logprob + rng.normal(0.0, s.logprob_sigma, size=n), 0.0).astype(np.float32)
        if s.nonfinite_fraction:
            bad = np.flatnonzero(response & (rng.random(n) < s.nonfinite_fraction))
            cand_lp[bad] = np.where(np.arange(len(bad)) % 2, np.nan, -np.inf)
        flip = rng.random(n) < s.logprob_sigma
        cand_top = np.where(flip, rng.integers(0, spec.vocab_size, size=n), top)
        cand = {
            "token_ids": tokens,
            "logprob": cand_lp,
            "logprob_valid": response,
            "top_token_id": cand_top,
            "top_logprob": cand_lp,
            "experts": None,
            "experts_valid": None,
            "router_margin": None,
            "kept_logmass": None,
        }
        if s.kept_logmass:
            base = kept if kept is not None else np.zeros(n, dtype=np.float32)
            cand["kept_logmass"] = np.minimum(base + rng.normal(0.0, 0.01, size=n), 0.0).astype(np.float32)
            outside = response & (rng.random(n) < s.outside_support_fraction)
            cand["logprob_valid"] = response & ~outside
        if shape.is_moe and s.routing:
            cand_experts = _perturb_routing(rng, experts, s.route_fraction, spec.num_experts)
            if s.shuffle_order:
                cand_experts = cand_experts[..., ::-1]
            cand["experts"], cand["experts_valid"] = np.ascontiguousarray(cand_experts), np.ones(n, dtype=bool)
            if margins is not None:  # the same router's margins, off by a relative rounding error
                cand["router_margin"] = (margins * (1 + rng.normal(0, 1e-3, margins.shape))).astype(np.float32)
        cand_records = _records(ids, prompt_lens, lengths, cand)
        writes.append(pool.submit(write_part, root / SCORES / s.name, cand_records, schema(s.kept_logmass), shape))
    return writes
