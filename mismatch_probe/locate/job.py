"""`probe locate RUN`: choose the sequences, run both configurations over them in small batches with hooks,
sum the measures, judge, and write RUN/locate/index.html.

One configuration is in memory at a time: side a runs over every batch, its records kept on disk (spill.py),
and is freed before side b loads and runs over the same batches against them. Each batch's tally is the one
made with both sides loaded at once, in the same order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe.engines.forward.scoring import BatchGrid
from mismatch_probe.engines.peak import free_memory
from mismatch_probe.errors import ProbeError
from mismatch_probe.locate.choose import Choice, choose, requests, training_sets
from mismatch_probe.locate.defaults import Sides, matched_set, resolve
from mismatch_probe.locate.measures import Row, Tally
from mismatch_probe.locate.rule import Verdict, judge
from mismatch_probe.locate.side import Select, Side
from mismatch_probe.locate.spec import EngineSpec, parse_spec
from mismatch_probe.locate.spill import Spill
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info
from mismatch_probe.progress import console
from mismatch_probe.rundir.layout import LOCATE as LOCATE_DIR
from mismatch_probe.rundir.layout import LOCATE_SPILL, Run

EXIT_BITWISE = 1


@dataclass(frozen=True)
class LocateJob:
    run: Path
    a: str | None = None  # SPEC text; None: from the run's manifests
    b: str | None = None
    worst: int = 4
    samples: int = 4
    batch_size: int = 4
    quiet: bool = False  # --json: no progress lines on the terminal


@dataclass
class LocateResult:
    sides: Sides
    choice: Choice
    rows: list[Row]
    verdict: Verdict
    tokens: int
    seconds: float
    page: Path | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_BITWISE if self.verdict.bitwise else 0


def _model(spec: EngineSpec, reference: ModelInfo | None) -> ModelInfo:
    info = load_model_info(spec.model)
    if reference is not None and info.num_hidden_layers != reference.num_hidden_layers:
        raise ProbeError(
            f"{spec.model}: {info.num_hidden_layers} layers, but {reference.path} has {reference.num_hidden_layers}; "
            "locate matches layers by index"
        )
    if reference is not None and info.moe_layer_indices != reference.moe_layer_indices:
        raise ProbeError(
            f"{spec.model}: MoE layers {list(info.moe_layer_indices)}, but {reference.path} has {list(reference.moe_layer_indices)}"
        )
    return info


def _side(spec: EngineSpec, info: ModelInfo):
    if spec.engine == "megatron":
        from mismatch_probe.locate.megatron_side import MegatronSide

        return MegatronSide(spec, info)
    return Side(spec, info)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _inputs(group: list) -> tuple[torch.Tensor, torch.Tensor, Select] | None:
    """One batch as both sides take it: its tokens, attention mask and the positions measured; None without any."""
    grid = BatchGrid.left_padded(group)
    targets = grid.targets(group)
    if len(targets.rows) == 0:
        return None
    select = Select(rows=torch.from_numpy(targets.rows), columns=torch.from_numpy(targets.columns), width=grid.width)
    return grid.tokens(group, 0), torch.from_numpy(grid.real()).long(), select


def _run_a(spec: EngineSpec, info: ModelInfo, batches: list, spill: Spill):
    """Side a over every batch, each record kept in `spill`; then a freed. Returns a's reduction (the judge's)."""
    side = _side(spec, info)
    for index, (tokens, attention, select) in enumerate(batches):
        record = side.forward(tokens, attention, select)
        spill.put(index, record)
        del record
    reduction = side.ops.reduction
    del side
    free_memory()  # side a's model is gone before side b's loads: one configuration in memory at a time
    return reduction


def _run_b(spec: EngineSpec, info: ModelInfo, batches: list, spill: Spill) -> Tally:
    """Side b over the same batches, each against a's record read back: the tally of both measures."""
    side = _side(spec, info)
    tally = Tally()
    try:
        for index, (tokens, attention, select) in enumerate(batches):
            a_record = spill.get(index)
            b_record = side.forward(tokens, attention, select)
            tally.add(a_record, b_record, side.own(a_record, b_record, select))
            del a_record, b_record
    finally:
        del side
        free_memory()
    return tally


def run_locate(job: LocateJob) -> LocateResult:
    from mismatch_probe.locate.page import write_page

    if job.worst < 0 or job.samples < 0 or job.batch_size < 1:
        raise ProbeError("--worst and --samples must be >= 0, --batch-size >= 1")
    started = time.perf_counter()
    given = [None if text is None else parse_spec(text, flag) for text, flag in ((job.a, "--a"), (job.b, "--b"))]
    run = Run(job.run)
    manifest = run.manifest()
    manifest.check_finished(run.manifest_path)
    sets = training_sets(run)
    ranked, _ = matched_set(run, sets)  # the worst sequences are the matched set's, as is side b by default
    sides = resolve(run, *given, ranked.name if ranked else None)
    choice = choose(run, ranked, job.worst, job.samples)
    batch = requests(run, choice.sample_ids)
    if not batch:
        raise ProbeError("--worst and --samples chose no sequence: give at least one of them > 0")
    say = (lambda text: None) if job.quiet else (lambda text: console.print(text, highlight=False, markup=False))
    for note in sides.notes:
        say(note)
    a_info = _model(sides.a, None)
    b_info = _model(sides.b, a_info)
    vocab = min(a_info.vocab_size, b_info.vocab_size)
    top = max(int(r.token_ids.max()) for r in batch)
    if top >= vocab:
        raise ProbeError(f"{run.root}: token id {top} is outside the vocabulary ({vocab}) of the models compared")
    say(f"locate: a = {sides.a.text()}, b = {sides.b.text()}; {len(batch)} sequences")
    batches = [b for b in (_inputs(group) for group in _batches(batch, job.batch_size)) if b is not None]
    spill = Spill(run.root / LOCATE_DIR / LOCATE_SPILL)
    try:
        reduction = _run_a(sides.a, a_info, batches, spill)
        tally = _run_b(sides.b, b_info, batches, spill)
    finally:
        spill.remove()
    if tally.tokens == 0:
        raise ProbeError(f"{run.root}: the chosen sequences have no response tokens to compare")
    rows = tally.rows()
    verdict = judge(rows, reduction, tally.tokens)
    result = LocateResult(
        sides=sides,
        choice=choice,
        rows=rows,
        verdict=verdict,
        tokens=tally.tokens,
        seconds=time.perf_counter() - started,
    )
    result.page = write_page(run, result)
    return result


def as_json(result: LocateResult) -> dict:
    verdict = result.verdict
    located = verdict.located
    return {
        "a": result.sides.a.text(),
        "b": result.sides.b.text(),
        "stand_ins": result.sides.notes,
        "sequences": {
            "worst": result.choice.worst,
            "sampled": result.choice.sampled,
            "ranked_by": result.choice.ranked_by,
        },
        "tokens": result.tokens,
        "bitwise_equal": verdict.bitwise,
        "located": None if located is None else {"layer": located.layer, "op": located.op},
        "own": None if located is None else located.own,
        "margin": verdict.margin,
        "largest_own": {"layer": verdict.largest.layer, "op": verdict.largest.op, "own": verdict.largest.own},
        "floors": verdict.floors,
        "sentence": verdict.sentence,
        "rows": [row.to_json() for row in result.rows],
        "page": None if result.page is None else str(result.page),
        "seconds": round(result.seconds, 3),
    }
