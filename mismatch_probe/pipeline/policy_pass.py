"""A rescore at a new policy's checkpoint (`probe rescore RUN --model NEW --old NAME`), paired with a score set
of the rollout's own checkpoint: what docs/staleness.md measures.

- `--old NAME` is the θ_old training pass the new pass is compared with: complete, of the same engine and dtype,
  itself of the rollout's checkpoint, and replayed as this pass is (`none` for none and r2, `r3` for r3).
- `--replay r2` feeds the new forward the experts the old set chose (every routed row): R2 of the Qwen team's
  formulation paper. `r3` feeds it the rollout's, as any R3 pass.
- `--router-logprobs` writes the router's log-probability of each chosen expert and, with `--old`, this
  forward's log-probability of each expert the old set chose (RSPO's router shift, read by the report).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.model.moe import adapter_named
from mismatch_probe.rundir.layout import MANIFEST, Run, canonical_dtype
from mismatch_probe.rundir.manifests import NEW_POLICY, RUNNING, ScoreManifest
from mismatch_probe.rundir.parts import check_part_order, read_part
from mismatch_probe.rundir.records import ScoreRequest
from mismatch_probe.schema import RoutingShape, experts_matrix
from mismatch_probe.vocab import NO_REPLAY, R2, R3, Replay

ROLLOUT_SOURCE = "rollout"


@dataclass(frozen=True)
class PolicyPass:
    """What makes a rescore a new policy's pass."""

    old: str  # the θ_old score set's name
    step: int | None  # the policy step of the new checkpoint (--policy-step)
    replay: Replay

    @property
    def replay_source(self) -> str | None:
        """Whose experts the new forward is fed: the old set's (R2), the rollout's (R3), or none."""
        return {R2: f"scores/{self.old}", R3: ROLLOUT_SOURCE}.get(self.replay)

    def manifest_entry(self) -> dict:
        return {"role": NEW_POLICY, "step": self.step, "old": self.old, "replay_source": self.replay_source}


def check_policy_options(
    old: str | None, replay: Replay, step: int | None, router_logprobs: bool, is_moe: bool
) -> None:
    """The options that only make sense together, checked before a model is loaded."""
    if replay == R2 and old is None:
        raise ProbeError("--replay r2 replays the routes of an --old score set: name it with --old NAME")
    if step is not None and old is None:
        raise ProbeError("--policy-step N labels a new policy's pass: name the θ_old score set with --old NAME")
    if step is not None and step < 0:
        raise ProbeError(f"--policy-step {step}: expected a step >= 0")
    if (router_logprobs or replay == R2) and not is_moe:
        flag = "--router-logprobs" if router_logprobs else "--replay r2"
        raise ProbeError(f"{flag} needs an MoE rollout, but this model is dense")


def check_router_logprobs(engine: str, model) -> None:
    """--router-logprobs reads the log-softmax over all experts of a softmax router, in the hf engine."""
    adapter = adapter_named(model.moe_family) if model.moe_family else None
    if engine != "hf" or adapter is None or not hasattr(adapter.style, "router_logprobs"):
        family = f"the {model.moe_family} family" if model.moe_family else f"'{model.architecture}'"
        raise ProbeError(
            f"--router-logprobs: the {engine} engine cannot read router log-probabilities of {family} (the hf engine "
            "reads them for softmax routers: Qwen2/3-MoE, Qwen3-Next, Mixtral, OLMoE, ERNIE-4.5-MoE, Hunyuan)"
        )


def check_old_set(run: Run, old: str, engine: str, dtype: str, replay: Replay) -> ScoreManifest:
    """The --old score set a new pass pairs with, or a one-line error naming the field that disqualifies it."""
    if old in ("", ".", "..") or Path(old).name != old:
        raise ProbeError(f"--old {old!r}: expected the name of a score set in {run.root / 'scores'}")
    path = run.score_dir(old) / MANIFEST
    if not path.is_file():
        known = ", ".join(run.score_sets()) or "none"
        raise ProbeError(f"--old {old}: {path}: no such score set (score sets: {known})")
    manifest = ScoreManifest.load(path)
    wanted_replay = R3 if replay == R3 else NO_REPLAY
    checks = (
        ("status", manifest.status != RUNNING, "complete", manifest.status),
        ("policy", not manifest.is_new_policy, "a set of the rollout's own checkpoint", "a new policy's pass"),
        ("engine", manifest.engine_name == engine, engine, manifest.engine_name),
        ("dtype", canonical_dtype(manifest.dtype) == canonical_dtype(dtype), dtype, manifest.dtype),
        (
            "replay",
            (manifest.replay or NO_REPLAY) == wanted_replay,
            f"{wanted_replay} (for --replay {replay})",
            manifest.replay,
        ),
    )
    for field_name, ok, expected, found in checks:
        if not ok:
            raise ProbeError(f"--old {old}: {path}: {field_name} is {found!r}, expected {expected}")
    return manifest


def attach_old_experts(
    requests: list[ScoreRequest], old_dir: Path, part: str, shape: RoutingShape, replay: bool, probe: bool
) -> None:
    """Give each request the old set's experts at every position: as the experts to replay (R2) and/or as those
    whose router log-probs the new forward reads. The old set's part of the same name must hold exactly the
    requests' samples and tokens."""
    if not (replay or probe):
        return
    path = old_dir / part
    if not path.is_file():
        raise ProbeError(f"{path}: file not found (the --old score set has no part for the rollout's {part})")
    columns = ["sample_id", "position", "token_id", "experts"]
    table = read_part(path, columns, shape)
    sample, position = table.column("sample_id").to_numpy(), table.column("position").to_numpy()
    check_part_order(path, sample, position)
    expected = np.concatenate([np.full(len(r), r.sample_id) for r in requests]) if requests else np.zeros(0)
    tokens = np.concatenate([r.token_ids for r in requests]) if requests else np.zeros(0)
    stored = table.column("token_id").to_numpy()
    if len(sample) != len(expected) or not np.array_equal(sample, expected) or not np.array_equal(stored, tokens):
        raise ProbeError(
            f"{path}: holds other samples or tokens than the rollout's {part} (expected the --old set scored this rollout)"
        )
    experts, valid = experts_matrix(table.column("experts"), shape, str(path))
    if replay and not valid.any():
        raise ProbeError(f"{path}: column 'experts': no routed row to replay (--replay r2)")
    offset = 0
    for request in requests:
        rows = slice(offset, offset + len(request))
        offset += len(request)
        if replay:
            request.replay_experts, request.replay_valid = experts[rows], valid[rows]
        if probe:
            request.old_experts = experts[rows].astype(np.int64)
