"""`probe diagnose`: check the input, sample the rollout if asked, plan the passes, run them in order within the
budget on one loaded engine per configuration, and keep RUN/diagnose/plan.json current after every pass.

A second `probe diagnose RUN` reuses every finished pass and continues an interrupted one. Exit codes: 0 finished
(budget skips included), 1 a pass failed (the others still ran), 2 bad input before any work (nothing created).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.engines.peak import PeakMeter, free_memory
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json, write_json_atomic
from mismatch_probe.pipeline.diagnose.checks import check_inputs, rollout_facts
from mismatch_probe.pipeline.diagnose.estimate import Speed, checkpoint_notes, estimate, order, prior_speed
from mismatch_probe.pipeline.diagnose.execute import Executor, finished
from mismatch_probe.pipeline.diagnose.job import DiagnoseJob
from mismatch_probe.pipeline.diagnose.memory import MEMORY, does_not_fit, memory_why, plan_memory, sizes
from mismatch_probe.pipeline.diagnose.passes import (
    BUDGET,
    END,
    FAILED,
    GENERATE,
    LOCATE,
    MATCHED,
    PLANNED,
    RAN,
    REUSED,
    SKIPPED,
    Pass,
)
from mismatch_probe.pipeline.diagnose.plan import plain_training_args, plan_passes, sweep_knobs
from mismatch_probe.progress import console
from mismatch_probe.rundir.layout import DIAGNOSE, PLAN_FILE, Run

PLAN_SCHEMA_VERSION = 1
NEEDS_MATCHED = ("r3", "quant", "sampling", "sweep", "locate")  # each pairs with, or reads, the matched pass


@dataclass
class Diagnosis:
    plan: dict
    passes: list[Pass]
    plan_path: Path | None
    page: Path

    def passes_in_order(self) -> list[Pass]:
        return order(self.passes)

    @property
    def exit_code(self) -> int:
        return 1 if any(p.status == FAILED for p in self.passes) else 0


def plan_path(run: Path) -> Path:
    return Path(run) / DIAGNOSE / PLAN_FILE


def run_diagnose(job: DiagnoseJob) -> Diagnosis:
    from mismatch_probe.engines.memory import device_of

    check_inputs(job)  # exit 2 before anything is created
    generated = None
    if job.generate is not None and not job.dry_run:
        meter = PeakMeter(device_of(job.generate.config))
        meter.start()
        generated = _generate(job)
        generate_peak = meter.stop()
        free_memory()  # the inference engine, dropped as generate returned, gone before a training pass loads
    facts = rollout_facts(job)
    passes = plan_passes(job, facts)
    model = job.model or facts.model
    dtype = job.dtype or facts.dtype or "bf16"
    plan_memory(
        passes,
        sizes(model, facts.tokens, facts.samples, job.batch_size),
        engine=job.train_engine,
        train_args=plain_training_args(job, model) if model else dict(job.train_args),
        dtype=dtype,
        rollout_dtype=facts.dtype or dtype,
    )
    if generated is not None:
        passes[0].status, passes[0].seconds, passes[0].result = generated
        if generated[0] == RAN:
            passes[0].memory.peak_bytes, passes[0].memory.peak_of = generate_peak.bytes, generate_peak.of
    _recall(passes, plan_path(job.run))
    _keep_generate(passes, plan_path(job.run))
    speed = prior_speed(job.model or facts.model)
    knobs = len(sweep_knobs(job.train_engine, facts.is_moe, job.dtype or facts.dtype or "bf16"))
    diagnosis = Diagnose(job, facts, passes, speed, knobs)
    if job.dry_run:
        diagnosis.dry_run()
    else:
        diagnosis.run()
    return diagnosis.result()


def _generate(job: DiagnoseJob) -> tuple[str, float, str]:
    from dataclasses import replace

    from mismatch_probe.pipeline.generate import run_generate
    from mismatch_probe.rundir.manifests import COMPLETE

    run = Run(job.run)
    if run.manifest_path.is_file() and run.manifest().status == COMPLETE:
        return REUSED, 0.0, f"the rollout in {job.run} is complete"
    started = time.perf_counter()
    run_generate(replace(job.generate, resume=run.manifest_path.is_file()))
    return RAN, time.perf_counter() - started, f"sampled {run.manifest().num_samples} samples into {job.run}"


def _recall(passes: list[Pass], path: Path) -> None:
    """An earlier diagnose's answers (locate's sentence, the doctor's finding): a pass whose command is the same
    (the run's folder may have moved since) keeps its answer, for reuse."""
    if not path.is_file():
        return
    plan = read_json(path)
    moved = lambda command: str(command).replace(str(plan.get("run")), str(path.parent.parent))  # noqa: E731
    earlier = {p.get("name"): p for p in plan.get("passes") or [] if isinstance(p, dict)}
    for p in passes:
        was = earlier.get(p.name) or {}
        if was.get("status") in (RAN, REUSED) and moved(was.get("command")) == p.command:
            p.result = str(was.get("result") or "")


def _keep_generate(passes: list[Pass], path: Path) -> None:
    """The rollout was sampled by an earlier diagnose of the second form: a diagnose of RUN alone keeps that pass,
    `reused`, with its command, so the plan (and the page's "How this was measured") still says how it was made."""
    if any(p.name == GENERATE for p in passes) or not path.is_file():
        return
    earlier = read_json(path).get("passes") or []
    was = next((p for p in earlier if isinstance(p, dict) and p.get("name") == GENERATE), None)
    if was is None or was.get("status") not in (RAN, REUSED):
        return
    command, result = str(was.get("command") or ""), str(was.get("result") or "")
    passes.insert(0, Pass(name=GENERATE, command=command, status=REUSED, seconds=0.0, result=result))


class Diagnose:
    def __init__(self, job: DiagnoseJob, facts, passes: list[Pass], speed: Speed, knobs: int):
        self.job, self.facts, self.passes, self.speed, self.knobs = job, facts, passes, speed, knobs
        self.sweep_loads = knobs if job.train_engine != "hf" else 0  # an engine that switches no knob in place
        self.executor: Executor | None = None
        self.loaded_group: str | None = None  # the configuration whose checkpoint the executor holds
        self.elapsed = 0.0
        run = Run(job.run)
        for p in passes:  # what an earlier diagnose (or a hand) finished is reused: no load planned for it
            if p.status == PLANNED and p.name not in END and run.manifest_path.is_file() and finished(run, p):
                p.status, p.seconds = REUSED, 0.0
        matched = next((p for p in passes if p.name == MATCHED), None)
        if matched is not None and matched.status == REUSED:  # its forwards' measured speed, from its manifest
            measured = run.score_manifest(matched.score_sets[0]).tokens_per_second
            if measured:
                self.speed = Speed(tokens_per_second=measured, load_s=speed.load_s, measured=True)
        self._estimate(loaded=None)
        self.planned_loads = checkpoint_notes(passes, self.sweep_loads)

    def _estimate(self, loaded: str | None) -> None:
        estimate(self.passes, self.facts, self.speed, loaded, self.knobs, self.sweep_loads)

    def dry_run(self) -> None:
        """The plan as it would run: what the budget would leave out, by the estimates."""
        spent, loaded, kept = 0.0, None, {}
        for p in order(self.passes):
            self._estimate(loaded)
            if p.status != PLANNED or p.name in (GENERATE, *END):
                continue
            skipped = self._skipped_matched(p)
            if skipped or self._over_budget(spent, p):
                p.skip(skipped or BUDGET)
                continue
            if does_not_fit(p, resident=p.group is not None and p.group == loaded):
                p.skip(MEMORY)
                continue
            spent, loaded = spent + (p.estimate_s or 0.0), p.group
            kept[p.name] = p.estimate_s  # as it would run: a later estimate sees its checkpoint loaded already
        for p in self.passes:
            p.estimate_s = kept.get(p.name, p.estimate_s)
        if Run(self.job.run).manifest_path.is_file():
            self.save()

    def _skipped_matched(self, p: Pass) -> str:
        """Why `p` cannot run when the matched pass it pairs with was skipped or failed ("budget" when the budget left
        that out); "" when it can."""
        matched = next((q for q in self.passes if q.name == MATCHED), None)
        if p.name in NEEDS_MATCHED and matched is not None and matched.status in (SKIPPED, FAILED):
            return BUDGET if matched.why == BUDGET else f"needs the matched pass, which was {matched.status}"
        return ""

    def _over_budget(self, spent: float, p: Pass) -> bool:
        return self.job.budget_s is not None and spent + (p.estimate_s or 0.0) > self.job.budget_s

    def run(self) -> None:
        run = Run(self.job.run)
        self.executor = Executor(job=self.job, run=run, dtype=self.job.dtype or self.facts.dtype or "bf16")
        started = time.perf_counter()
        try:
            while (p := next((q for q in order(self.passes) if q.status == PLANNED), None)) is not None:
                self.elapsed = time.perf_counter() - started
                self._one(p)
                self.save()
        except KeyboardInterrupt:
            self.save()  # the same command continues: finished passes are reused, the interrupted one resumed
            raise
        finally:
            self.executor.close()
        self.elapsed = time.perf_counter() - started
        self.save()

    def _one(self, p: Pass) -> None:
        """Run, reuse or skip one pass."""
        self._estimate(self.loaded_group)  # a pass skipped or run since moves the next load to another pass
        skipped = self._skipped_matched(p)
        if skipped:
            p.skip(skipped)
            return
        if p.name in END:
            if not Run(self.job.run).score_sets():
                p.skip("no score set to read: the scoring passes were skipped or failed")
                return
            if p.result and self._end_current(p) and not self._ran_before_end():
                p.status, p.seconds = REUSED, 0.0
                return
        elif finished(self.executor.run, p):
            p.status, p.seconds = REUSED, 0.0
            return
        elif self._over_budget(self.elapsed, p):
            p.skip(BUDGET)
            return
        if self._does_not_fit(p):
            return
        console.rule(f"[bold]diagnose: {p.name}[/] ({p.question})")
        started = time.perf_counter()
        meter = PeakMeter(p.memory.device if p.memory is not None else "cpu")
        meter.start()
        try:
            p.result = self.executor.run_pass(p)
            p.status, p.why = RAN, ""
        except (ProbeError, RuntimeError, ValueError, OSError, MemoryError) as err:
            p.status, p.why = FAILED, _why(err)
            console.print(f"diagnose: {p.name} failed: {p.why}", highlight=False, markup=False)
        p.seconds = time.perf_counter() - started
        if p.memory is not None:
            peak = meter.stop()
            p.memory.peak_bytes, p.memory.peak_of = peak.bytes, peak.of
        if p.group is not None or p.name == LOCATE:  # locate closes the training engine to load its own
            self.loaded_group = p.group
        if p.name == MATCHED and p.status == RAN:
            self._measured()

    def _does_not_fit(self, p: Pass) -> bool:
        """Free the loaded configuration when `p` needs another (one configuration in memory at a time), then skip
        `p` with why "memory" where its estimate exceeds what the device has free."""
        resident = p.group is not None and p.group == self.loaded_group
        if not resident and (p.group is not None or p.name == LOCATE):
            self.executor.loaded.close()
            self.loaded_group = None
        if not does_not_fit(p, resident):
            return False
        p.skip(MEMORY)
        console.print(f"diagnose: {p.name} skipped: {memory_why(p)}", highlight=False, markup=False)
        return True

    def _ran_before_end(self) -> bool:
        return any(q.status in (RAN, FAILED) for q in self.passes if q.name not in END)

    def _end_current(self, p: Pass) -> bool:
        """The doctor's and the report's answers still hold when nothing ran since they did."""
        run = Run(self.job.run)
        return p.name != "report" or run.metrics_path.is_file()

    def _measured(self) -> None:
        """The matched pass's speed and load replace the prior guesses for every pass still planned."""
        ex = self.executor
        if ex.tokens_per_second:
            self.speed = Speed(
                tokens_per_second=ex.tokens_per_second,
                load_s=ex.load_s if ex.load_s is not None else self.speed.load_s,
                measured=True,
            )
            self._estimate(self.loaded_group)

    def save(self) -> None:
        path = plan_path(self.job.run)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.to_json())

    def to_json(self) -> dict:
        made = self.executor.loaded.builds if self.executor is not None else 0
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "run": str(self.job.run),
            "budget_s": self.job.budget_s,
            "passes": [p.to_json() for p in order(self.passes)],
            "checkpoint_loads": {
                "planned": self.planned_loads,
                "made": made,
                "note": "training-engine loads; passes of one engine, dtype and weights share one through "
                "reconfigure. locate loads its own two hooked models"
                + ("" if not any(p.name == LOCATE and p.status == RAN for p in self.passes) else " (ran)"),
            },
            "tokens": self.facts.tokens,
            "tokens_per_second": {"value": round(self.speed.tokens_per_second, 1), "measured": self.speed.measured},
            "elapsed_s": round(self.elapsed, 2),
        }

    def result(self) -> Diagnosis:
        path = plan_path(self.job.run)
        return Diagnosis(
            plan=self.to_json(),
            passes=self.passes,
            plan_path=path if path.is_file() else None,
            page=Run(self.job.run).report_dir / "index.html",
        )


def _why(err: BaseException) -> str:
    """A failed pass's why: a ProbeError's line (out of memory at a stage that names itself included), an
    allocator's error as the one line engines/memory.py gives it, else the error's type and text."""
    from mismatch_probe.engines.memory import is_out_of_memory, unplaced_line

    if isinstance(err, ProbeError):
        return str(err)
    if is_out_of_memory(err):
        return unplaced_line(err)
    return f"{type(err).__name__}: {err}"
