"""`probe sweep`: score RUN's tokens under a base training configuration and under variants of it, each changing
one knob, and record them in RUN/sweep.json for the report's "Measured remedies" (docs/remedies.md).

Sibling runs are sampled first (each needs the inference model, and holding a training engine meanwhile would
keep two checkpoints in memory), then every score set, in an order that loads each engine and dtype once.
Finished score sets and sibling runs are reused and interrupted ones resumed, so the same command picks up
where an interrupted sweep stopped; sweep.json is written as each variant finishes.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from rich.table import Table

from mismatch_probe.engines import check_engine_args, resolved_options
from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.engines.extras import require_engine
from mismatch_probe.engines.forward.scoring import is_writer_rank
from mismatch_probe.engines.peak import free_memory
from mismatch_probe.engines.weight_files import weights_sha256
from mismatch_probe.errors import ProbeError
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info
from mismatch_probe.pipeline.rescore import RescoreJob, make_score_folders, prepare_rescore, score_with
from mismatch_probe.pipeline.sweep.knobs import Setting, parse_vary
from mismatch_probe.pipeline.sweep.loaded import LoadedEngine
from mismatch_probe.pipeline.sweep.plan import Entry, SweepJob, Task, plan_entries, task_order
from mismatch_probe.pipeline.sweep.siblings import ensure_sibling, sibling_job, sibling_wanted
from mismatch_probe.pipeline.sweep.state import (
    ABSENT,
    FINISH,
    RESUME,
    REUSE,
    STALE,
    plain,
    rollout_state,
    score_set_manifest,
    score_state,
)
from mismatch_probe.progress import console, stdout_console
from mismatch_probe.rundir.layout import MANIFEST, Run, default_score_name
from mismatch_probe.rundir.manifests import COMPLETE, RolloutManifest
from mismatch_probe.rundir.roles import SWEEP as SWEEP_ROLE
from mismatch_probe.rundir.sweep import SweepFile, SweepVariant
from mismatch_probe.vocab import DTYPES, NO_REPLAY

SAME_AS_BASE = "= base"


def run_sweep(job: SweepJob, loaded: LoadedEngine | None = None, show: bool = True) -> SweepFile:
    """`loaded`: an engine a caller keeps loaded across its own passes and closes itself (`probe diagnose`);
    `show`: print the sweep's table on stdout."""
    run = Run(job.run)
    manifest = run.manifest()
    manifest.check_finished(run.manifest_path)
    require_engine(job.engine)
    if job.config.dtype not in DTYPES:
        raise ProbeError(f"--dtype: '{job.config.dtype}' is not one of {', '.join(DTYPES)}")
    check_engine_args("training", job.engine, job.config.engine_args)
    base = Setting(dtype=job.config.dtype, engine_args=dict(job.config.engine_args))
    knobs = parse_vary(list(job.vary), job.engine, manifest.engine_name)
    base_name = default_score_name(job.engine, base.dtype, NO_REPLAY)
    entries = plan_entries(run, manifest, job.engine, base, base_name, knobs)
    if any(entry.sibling for entry in entries) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ProbeError(
            "--vary rollout:/both: sibling runs are sampled in one process; sweep them without torchrun first, "
            "then the training variants under torchrun reuse them"
        )
    sweep = Sweep(job, run, manifest, base, base_name, entries, loaded)
    try:
        sweep.check_existing()
        sweep.make_siblings()
        sweep.score_all()
    finally:
        if loaded is None:
            sweep.loaded.close()
    if show and is_writer_rank():
        print_sweep(sweep)
    return sweep.file()


class Sweep:
    """A sweep under way: its entries, the one loaded engine, and what each score set and sibling run became."""

    def __init__(
        self,
        job: SweepJob,
        run: Run,
        manifest: RolloutManifest,
        base: Setting,
        base_name: str,
        entries: list[Entry],
        loaded: LoadedEngine | None = None,
    ):
        self.job, self.run, self.manifest, self.base, self.base_name = job, run, manifest, base, base_name
        self.entries = entries
        self.loaded = loaded or LoadedEngine(job.engine, job.config.batch_size)
        self.weights = functools.cache(weights_sha256)  # each checkpoint's files hashed once, not once per set
        self.models: dict[str, ModelInfo] = {}
        self.outcomes: dict[tuple[Path, str], str] = {}  # (run, score set) -> scored, resumed, reused or = base
        self.siblings: dict[Path, str] = {}  # sibling run -> generated, resumed or reused
        self.tasks = task_order(entries, Task(run=run.root, name=base_name, setting=base, is_base=True))
        self.earlier = self._earlier_variants()

    def _earlier_variants(self) -> dict[tuple, SweepVariant]:
        """The variants an earlier sweep of the same base recorded (kept in sweep.json; their = base decisions
        trusted, which spares configuring an engine again to repeat them)."""
        earlier = SweepFile.load(self.run.root)
        same = earlier and (earlier.engine, earlier.dtype, earlier.engine_args, earlier.base) == (
            self.job.engine,
            self.base.dtype,
            self.base.engine_args,
            self.base_name,
        )
        variants = {variant_key(v.side, v.changed): v for v in earlier.variants} if same else {}
        for entry in self.entries:
            was = variants.get(variant_key(entry.knob.side, entry.knob.changed))
            if (
                was
                and was.score_set == self.base_name != entry.score_set
                and was.run == entry.record(self.run.root).run
            ):
                self._same_as_base(entry.run, entry.score_set)
        return variants

    def check_existing(self) -> None:
        """Refuse, before any work, a score set or sibling run that exists but was made otherwise (unless
        --overwrite replaces it)."""
        for entry in self.entries:
            if entry.sibling and entry.sibling not in self.siblings:
                state = rollout_state(entry.sibling, sibling_wanted(self.manifest, self._sibling_job(entry)))
                if state.kind == STALE and not self.job.overwrite:
                    raise state.refuse("the sibling run", entry.sibling)
        for task in self.tasks:
            if (task.run / "manifest.json").is_file():
                state = self._state(task)
                if state.kind == STALE and not self.job.overwrite:
                    raise state.refuse(f"score set '{task.name}'", Run(task.run).score_dir(task.name))

    def _sibling_job(self, entry: Entry):
        return sibling_job(self.run, self.manifest, entry.rollout_setting, entry.sibling)

    def make_siblings(self) -> None:
        flags = {"trust_remote_code": self.job.trust_remote_code, "moe_family": self.job.moe_family}
        for entry in self.entries:
            if entry.sibling and entry.sibling not in self.siblings:
                self.loaded.close()  # one model in memory at a time: the sibling's inference engine loads next
                done = ensure_sibling(
                    self.run, self.manifest, entry.rollout_setting, entry.sibling, self.job.overwrite, **flags
                )
                self.siblings[entry.sibling] = done
                free_memory()  # the sibling's inference engine, gone with run_generate, before the next load
                console.print(f"sweep: sibling run {entry.sibling.name} {done}", highlight=False)

    def score_all(self) -> None:
        for task in self.tasks:
            if (task.run, task.name) in self.outcomes:  # = base, decided by an earlier sweep
                continue
            self.outcomes[(task.run, task.name)] = outcome = self._score(task)
            console.print(f"sweep: {Run(task.run).score_dir(task.name)} {outcome}", highlight=False)
            if outcome == SAME_AS_BASE:
                self._same_as_base(task.run, task.name)
            self.save()

    def _state(self, task: Task):
        options = resolved_options("training", self.job.engine, task.setting.engine_args)
        return score_state(Run(task.run), task.name, self.job.engine, task.setting.dtype, options)

    def _score(self, task: Task) -> str:
        state = self._state(task)
        if state.kind == REUSE:
            return "reused"
        if state.kind == FINISH:  # nothing left to score: no engine needed to mark it finished
            finished = Run(task.run).score_manifest(task.name)
            finished.status = COMPLETE
            if is_writer_rank():
                finished.save(Run(task.run).score_dir(task.name) / MANIFEST)
            return "resumed"
        if state.kind == STALE and not self.job.overwrite:
            raise state.refuse(f"score set '{task.name}'", Run(task.run).score_dir(task.name))
        if not task.is_base and state.kind == ABSENT and self._describes_base(task):
            return SAME_AS_BASE
        config = EngineConfig(
            dtype=task.setting.dtype, batch_size=self.job.config.batch_size, engine_args=dict(task.setting.engine_args)
        )
        rescore = RescoreJob(
            run=task.run,
            engine=self.job.engine,
            config=config,
            name=task.name,
            role=None if task.is_base else SWEEP_ROLE,  # the base keeps the role its options imply
            resume=state.kind == RESUME,
            overwrite=state.kind == STALE,
            trust_remote_code=self.job.trust_remote_code,
            moe_family=self.job.moe_family,
        )
        plan = prepare_rescore(rescore, weights_of=self.weights, make_folders=False)
        engine = self.loaded.get(task.setting, plan.model)
        make_score_folders(plan)  # once loaded: a load that fails leaves no folder
        score_with(plan, engine)
        return "resumed" if state.kind == RESUME else "scored"

    def _describes_base(self, task: Task) -> bool:
        """A variant whose options differ from the base's only in knobs the engine records with their effective
        value in describe() (e.g. an attention implementation that is already the default), and whose engine,
        once configured, describes itself and its quantization exactly as the base's score set records: the base."""
        recorded = score_set_manifest(Run(task.run), self.base_name)
        if recorded is None or task.setting.dtype != self.base.dtype or not isinstance(recorded.engine, dict):
            return False
        ours = resolved_options("training", self.job.engine, task.setting.engine_args)
        theirs = resolved_options("training", self.job.engine, self.base.engine_args)
        differing = [key for key in ours if plain(ours[key]) != plain(theirs.get(key))]
        if not differing or not all(_records(recorded.engine, key) for key in differing):
            return False  # the describe cannot tell: the variant is scored
        engine = self.loaded.get(task.setting, self._model(task.run))
        return plain(engine.describe()) == plain(recorded.engine) and plain(engine.quantization()) == plain(
            recorded.quantization
        )

    def _model(self, root: Path) -> ModelInfo:
        path = Run(root).manifest().model
        if path not in self.models:
            self.models[path] = load_model_info(path, self.job.trust_remote_code, self.job.moe_family)
        return self.models[path]

    def _same_as_base(self, root: Path, name: str) -> None:
        """The score set `name` of `root` is the base's: every entry that needed it uses the base's instead."""
        self.outcomes[(root, name)] = SAME_AS_BASE
        for entry in self.entries:
            if entry.run == root and entry.score_set == name:
                entry.score_set = self.base_name
                entry.tasks = [t for t in entry.tasks if t.name != name]
        self.tasks = [t for t in self.tasks if (t.run, t.name) != (root, name)]

    def finished(self, entry: Entry) -> bool:
        return all((task.run, task.name) in self.outcomes for task in entry.tasks)

    def file(self) -> SweepFile:
        """sweep.json: the finished variants in --vary order (an unfinished one as an earlier sweep recorded it),
        then the earlier sweep's other variants."""
        ours = {variant_key(e.knob.side, e.knob.changed) for e in self.entries}
        variants = [
            entry.record(self.run.root)
            if self.finished(entry)
            else self.earlier.get(variant_key(entry.knob.side, entry.knob.changed))
            for entry in self.entries
        ]
        variants += [v for key, v in self.earlier.items() if key not in ours]
        return SweepFile(
            engine=self.job.engine,
            dtype=self.base.dtype,
            engine_args=dict(self.base.engine_args),
            base=self.base_name,
            variants=[v for v in variants if v is not None],
        )

    def save(self) -> None:
        if is_writer_rank() and (self.run.root, self.base_name) in self.outcomes:  # the base scored: a sweep to read
            self.file().save(self.run.root)


def variant_key(side: str, changed: dict) -> tuple[str, str]:
    """A variant's identity across sweeps: its side and what it changed."""
    return side, json.dumps(changed, sort_keys=True)


def _records(describe: dict, key: str) -> bool:
    """`describe` (nested) has an entry named `key`."""
    return any(k == key or (isinstance(v, dict) and _records(v, key)) for k, v in describe.items())


def print_sweep(sweep: Sweep) -> None:
    table = Table(title=f"sweep of {sweep.run.root} (base {sweep.base_name})")
    for column in ("variant", "side", "changed", "run", "score set", "done"):
        table.add_column(column)
    base_done = sweep.outcomes.get((sweep.run.root, sweep.base_name), "")
    table.add_row(sweep.base_name, "base", "", ".", sweep.base_name, base_done)
    for entry in sweep.entries:
        record = entry.record(sweep.run.root)
        done = sweep.outcomes.get((entry.run, entry.score_set), "")
        if entry.score_set == sweep.base_name and entry.run == sweep.run.root:
            done = SAME_AS_BASE
        if entry.sibling:
            done = f"rollout {sweep.siblings.get(entry.sibling, '')}, {done}"
        changed = ", ".join(f"{k}={v}" for k, v in record.changed.items())
        table.add_row(record.variant, record.side, changed, record.run, record.score_set, done)
    stdout_console().print(table)
    loaded = sweep.loaded
    console.print(
        f"checkpoint loads: {loaded.builds}; variants switched on a loaded model: {loaded.reconfigured}",
        highlight=False,
    )
