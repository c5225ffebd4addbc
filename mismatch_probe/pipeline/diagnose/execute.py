"""Running one pass of the plan: a rescore on the one loaded training engine, the sweep on the same engine, locate,
the doctor and the report. Each returns its answer in one line; a `ProbeError` or an engine's failure fails the
pass alone (run.py records it and goes on).

Reuse and resume follow `probe rescore --resume`: a pass whose score sets are complete (every rollout part scored,
manifest finished) is reused without opening a file under RUN/scores/; one begun is continued, keeping its
finished parts.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field

from mismatch_probe.engines.base import EngineConfig
from mismatch_probe.engines.weight_files import weights_sha256
from mismatch_probe.pipeline.diagnose.job import DiagnoseJob
from mismatch_probe.pipeline.diagnose.passes import (
    ENGINE_PREFILL_PASS,
    FP32,
    LOCATE,
    MATCHED,
    QUANT,
    R3_PASS,
    REPEATS,
    SAMPLING,
    SWEEP,
    Pass,
)
from mismatch_probe.pipeline.diagnose.plan import LOCATE_SAMPLES, LOCATE_WORST, locate_reference, plain_training_args
from mismatch_probe.pipeline.rescore import RescoreJob, make_score_folders, prepare_rescore, run_rescore, score_with
from mismatch_probe.pipeline.sweep.knobs import Setting
from mismatch_probe.pipeline.sweep.loaded import LoadedEngine
from mismatch_probe.quant.served import matched_quant_args
from mismatch_probe.rundir.layout import LOCATE as LOCATE_DIR
from mismatch_probe.rundir.layout import MANIFEST, Run
from mismatch_probe.rundir.manifests import COMPLETE, ScoreManifest
from mismatch_probe.rundir.parts import part_files
from mismatch_probe.rundir.sweep import SWEEP_FILE, THIS_RUN, TRAINING_SIDE, SweepFile
from mismatch_probe.vocab import FP32 as FP32_DTYPE
from mismatch_probe.vocab import NO_REPLAY, R3, RAW, ROLLOUT_SAMPLING


def score_sets_state(run: Run, names: list[str]) -> str:
    """done: every set complete with a part per rollout part; begun: some folder holds something; else absent."""
    rollout = [p.name for p in part_files(run.rollout_dir)]
    done = True
    for name in names:
        folder = run.score_dir(name)
        path = folder / MANIFEST
        complete = path.is_file() and ScoreManifest.load(path).status == COMPLETE
        done = done and complete and [p.name for p in part_files(folder)] == rollout
    if done:
        return "done"
    begun = any(run.score_dir(n).is_dir() and any(run.score_dir(n).iterdir()) for n in names)
    return "begun" if begun else "absent"


def finished(run: Run, p: Pass) -> bool:
    """The pass's output is there from an earlier diagnose (or made by hand): it is reused."""
    if p.name == SWEEP:
        return _swept(run, p)
    if p.name == LOCATE:
        return (run.root / LOCATE_DIR / "index.html").is_file() and bool(p.result)
    if p.score_sets:
        return score_sets_state(run, p.score_sets) == "done"
    return False


def _swept(run: Run, p: Pass) -> bool:
    """sweep.json records every knob of the pass (a variant equal to the base as the base's set), with the base
    and every score set it names complete."""
    swept = SweepFile.load(run.root) if (run.root / SWEEP_FILE).is_file() else None
    if swept is None:
        return False
    recorded = {(v.side, json.dumps(v.changed, sort_keys=True)): v for v in swept.variants}
    wanted = [(TRAINING_SIDE, json.dumps(dict([k.split("=", 1)]), sort_keys=True)) for k in p.knobs]
    if not all(key in recorded and recorded[key].run == THIS_RUN for key in wanted):
        return False
    return score_sets_state(run, [swept.base, *(recorded[key].score_set for key in wanted)]) == "done"


@dataclass
class Executor:
    """The diagnosis under way: the job, the run, the one loaded training engine and what it measured."""

    job: DiagnoseJob
    run: Run
    dtype: str
    loaded: LoadedEngine = field(init=False)
    tokens_per_second: float | None = None  # the matched pass's, measured
    load_s: float | None = None  # its checkpoint load's, measured

    def __post_init__(self):
        self.loaded = LoadedEngine(self.job.train_engine, self.job.batch_size)
        self.weights = functools.cache(weights_sha256)

    def run_pass(self, p: Pass) -> str:
        if p.name == ENGINE_PREFILL_PASS:
            return self._engine_prefill(p)
        if p.name in (MATCHED, FP32, REPEATS, R3_PASS, QUANT, SAMPLING):
            return self._rescore(p)
        return getattr(self, f"_{p.name}")(p)

    def _setting(self, p: Pass) -> tuple[str, dict]:
        manifest = self.run.manifest()
        model = self.job.model or manifest.model
        if p.name == QUANT:
            args = dict(self.job.train_args) | (matched_quant_args(manifest.quantization, model) or {})
        else:
            args = plain_training_args(self.job, model)
        return (FP32_DTYPE if p.name == FP32 else self.dtype), args

    def _rescore(self, p: Pass) -> str:
        dtype, args = self._setting(p)
        rescore = RescoreJob(
            run=self.run.root,
            engine=self.job.train_engine,
            config=EngineConfig(dtype=dtype, batch_size=self.job.batch_size, engine_args=args),
            model=self.job.model,
            replay=R3 if p.name == R3_PASS else NO_REPLAY,
            repeats=2 if p.name == REPEATS else 1,
            vary_batching=p.name == REPEATS,
            name=p.score_sets[0] if p.name in (QUANT, SAMPLING) else None,
            role=p.name,  # each scoring pass's name is its role (rundir/roles.py): matched, fp32, r3, ...
            resume=score_sets_state(self.run, p.score_sets) == "begun",
            sampling=ROLLOUT_SAMPLING if p.name == SAMPLING else RAW,
            trust_remote_code=self.job.trust_remote_code,
            moe_family=self.job.moe_family,
        )
        plan = prepare_rescore(rescore, weights_of=self.weights, make_folders=False)
        started, builds = time.perf_counter(), self.loaded.builds
        engine = self.loaded.get(Setting(dtype=dtype, engine_args=args), plan.model)
        load_s = time.perf_counter() - started
        make_score_folders(plan)  # once loaded: a load that fails leaves no folder
        started = time.perf_counter()
        score_with(plan, engine)
        seconds = time.perf_counter() - started
        tokens = sum(_rows(part) for part in part_files(self.run.rollout_dir)) * len(plan.names)
        if p.name == MATCHED:
            self.tokens_per_second = tokens / max(seconds, 1e-9)
            if self.loaded.builds > builds:
                self.load_s = load_s
        loaded = "loaded" if self.loaded.builds > builds else "shared"
        return f"scored {', '.join(plan.names)} ({tokens:,} positions, {tokens / max(seconds, 1e-9):,.0f}/s; checkpoint {loaded})"

    def _engine_prefill(self, p: Pass) -> str:
        """The rollout's own inference engine scores it by prefill (a server at its recorded URL, or an in-process
        engine built from its recorded options; no training checkpoint loaded)."""
        manifest = self.run.manifest()
        rescore = RescoreJob(
            run=self.run.root,
            engine=manifest.engine_name,
            config=EngineConfig(dtype=self.dtype, batch_size=self.job.batch_size),  # an in-process engine's dtype
            resume=score_sets_state(self.run, p.score_sets) == "begun",
        )
        names = run_rescore(rescore)
        return f"scored {', '.join(names)} by {manifest.engine_name}'s own prefill"

    def _sweep(self, p: Pass) -> str:
        from mismatch_probe.pipeline.sweep.plan import SweepJob
        from mismatch_probe.pipeline.sweep.run import run_sweep

        job = SweepJob(
            run=self.run.root,
            engine=self.job.train_engine,
            config=EngineConfig(
                dtype=self.dtype,
                batch_size=self.job.batch_size,
                engine_args=plain_training_args(self.job, self.job.model or self.run.manifest().model),
            ),
            vary=tuple(p.knobs),
            trust_remote_code=self.job.trust_remote_code,
            moe_family=self.job.moe_family,
        )
        swept = run_sweep(job, loaded=self.loaded, show=False)
        return f"swept {len(swept.variants)} variant(s) of {swept.base}: {', '.join(v.variant for v in swept.variants)}"

    def _locate(self, p: Pass) -> str:
        from mismatch_probe.locate.defaults import SameSides
        from mismatch_probe.locate.job import LocateJob, run_locate

        self.loaded.close()  # one checkpoint in memory at a time: locate loads its own two
        b = locate_reference(self.job.train_engine, self.dtype)
        job = LocateJob(run=self.run.root, b=b, worst=LOCATE_WORST, samples=LOCATE_SAMPLES, quiet=True)
        try:
            result = run_locate(job)
        except SameSides as same:  # the rollout's setup is the matched set's: an answer, not a failure
            return f"nothing to locate: {str(same).removeprefix('locate: ').split(': nothing')[0]}"
        return result.verdict.sentence

    def _doctor(self, p: Pass) -> str:
        from mismatch_probe.doctor.run import run_checks

        findings = run_checks(self.run.root)
        if not findings:
            return "no setup bug found"
        return "; ".join(f"{f.check}: {f.found}" for f in findings)

    def _report(self, p: Pass) -> str:
        from mismatch_probe.report.build import build_report
        from mismatch_probe.report.verdict.production import quantized_sides
        from mismatch_probe.report.verdict.summary import rows, verdict

        report = build_report(self.run.root, pairs=self._report_pairs())
        infos = self.run.side_infos()
        is_moe = self.run.manifest().routing.is_moe
        return verdict(report.metrics, rows(report.metrics, infos, report.bands, is_moe, quantized_sides(self.run)))

    def _report_pairs(self) -> list[str] | None:
        """None: the report's remembered pairs, which are the run's defaults unless someone replaced them; then
        the rollout against every score set and the repeated passes against each other join them."""
        from mismatch_probe.report.keys.request import remembered

        earlier = remembered(self.run)
        if earlier is None or earlier.default_pairs:
            return None
        sets = self.run.score_sets()
        repeats = [(a, f"{a[:-1]}2") for a in sets if a.endswith("-pass1") and f"{a[:-1]}2" in sets]
        return [f"+rollout:scores/{name}" for name in sets] + [f"+scores/{a}:scores/{b}" for a, b in repeats]

    def close(self) -> None:
        self.loaded.close()


def _rows(part) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(part).metadata.num_rows
