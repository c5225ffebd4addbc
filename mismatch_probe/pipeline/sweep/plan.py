"""What a sweep will measure: one entry per variant, each naming the run and score set it is compared through, and
the score sets (tasks) those need.

Names: a training variant's score set is the base's name plus `+KNOB-VALUE` (`hf-bf16+lm_head_dtype-fp32`); a
rollout-side variant is the sibling run `RUN+rollout.KNOB-VALUE`, scored with the base configuration under the
base's name, and a `both` variant adds the training-side set `BASE+KNOB-VALUE` in that sibling. A variant that
resolves to the base configuration is the base: its score set is the base's and nothing more is computed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.pipeline.sweep.knobs import Knob, Setting
from mismatch_probe.pipeline.sweep.siblings import rollout_setting, same_rollout, sibling_path
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.manifests import RolloutManifest
from mismatch_probe.rundir.sweep import BOTH_SIDES, ROLLOUT_SIDE, THIS_RUN, SweepVariant


@dataclass(frozen=True)
class SweepJob:
    run: Path
    engine: str
    config: EngineConfig  # the base: its dtype, micro-batch size and --engine-arg values
    vary: tuple[str, ...] = ()  # --vary [SIDE:]KNOB=V1,V2
    overwrite: bool = False  # replace score sets and sibling runs made otherwise than the sweep would
    trust_remote_code: bool = False
    moe_family: str | None = None


@dataclass(frozen=True, kw_only=True)
class Task:
    """One score set to have: scored, resumed or reused."""

    run: Path
    name: str
    setting: Setting
    is_base: bool


@dataclass(kw_only=True)
class Entry:
    """One variant and what it needs."""

    knob: Knob
    variant: str
    run: Path  # the run holding its rollout: RUN or a sibling
    score_set: str
    tasks: list[Task]
    sibling: Path | None = None  # a sibling run to generate first
    rollout_setting: Setting | None = None  # the sibling's inference dtype and options
    notes: list[str] = field(default_factory=list)  # what was done: generated, scored, reused, resumed, = base

    def record(self, root: Path) -> SweepVariant:
        relative = THIS_RUN if self.run == root else os.path.relpath(self.run, root)
        return SweepVariant(
            variant=self.variant, side=self.knob.side, changed=self.knob.changed, run=relative, score_set=self.score_set
        )


def plan_entries(
    run: Run, manifest: RolloutManifest, engine: str, base: Setting, base_name: str, knobs: list[Knob]
) -> list[Entry]:
    resolved_base = base.resolved("training", engine)
    entries = []
    for knob in knobs:
        trained = base.with_knob(knob) if knob.trains else base
        equal = trained.resolved("training", engine) == resolved_base
        name = base_name if equal else f"{base_name}+{knob.label}"
        where, sibling, inference = run.root, None, None
        if knob.rolls_out:
            inference = rollout_setting(manifest, run.manifest_path).with_knob(knob)
            if not same_rollout(manifest, inference):
                where = sibling = sibling_path(run, knob)
        tasks = [Task(run=where, name=base_name, setting=base, is_base=True)]
        if not equal:
            tasks.append(Task(run=where, name=name, setting=trained, is_base=False))
        if knob.side == ROLLOUT_SIDE:
            variant = sibling.name if sibling else base_name
        elif knob.side == BOTH_SIDES and sibling:
            variant = f"{run.root.name}+both.{knob.label}"
        else:
            variant = f"{base_name}+{knob.label}"
        entries.append(
            Entry(
                knob=knob,
                variant=variant,
                run=where,
                score_set=name,
                tasks=tasks,
                sibling=sibling,
                rollout_setting=inference,
            )
        )
    return entries


def task_order(entries: list[Entry], base: Task) -> list[Task]:
    """Every task once, `base` (the base's score set in RUN) among them, in the order that loads least: the tasks
    of one dtype together, within them those of one setting (the base's first), RUN's before its siblings'. An engine that cannot switch a setting
    on a loaded model then loads once per setting, and one that can, once per dtype."""
    tasks: dict[tuple[Path, str], Task] = {(base.run, base.name): base}
    for entry in entries:
        for task in entry.tasks:
            tasks.setdefault((task.run, task.name), task)
    order = list(tasks.values())
    dtypes = list(dict.fromkeys(t.setting.dtype for t in order))
    settings = list(dict.fromkeys(_spelled(t.setting) for t in order))
    runs = list(dict.fromkeys(t.run for t in order))
    return sorted(
        order,
        key=lambda t: (dtypes.index(t.setting.dtype), settings.index(_spelled(t.setting)), runs.index(t.run)),
    )


def _spelled(setting: Setting) -> str:
    return json.dumps(setting.engine_args, sort_keys=True)
