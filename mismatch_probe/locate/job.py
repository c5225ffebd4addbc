"""`probe locate RUN`: choose the sequences, run both configurations over them in small batches with hooks,
sum the measures, judge, and write RUN/locate/index.html."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe.engines.forward.scoring import BatchGrid
from mismatch_probe.errors import ProbeError
from mismatch_probe.locate.choose import Choice, choose, requests, training_sets
from mismatch_probe.locate.defaults import Sides, matched_set, resolve
from mismatch_probe.locate.measures import Row, Tally
from mismatch_probe.locate.rule import Verdict, judge
from mismatch_probe.locate.side import Select, Side
from mismatch_probe.locate.spec import EngineSpec, parse_spec
from mismatch_probe.model.routing_shape import ModelInfo, load_model_info
from mismatch_probe.progress import console
from mismatch_probe.rundir.layout import Run

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
    a_side, b_side = _side(sides.a, a_info), _side(sides.b, b_info)
    tally = Tally()
    for group in _batches(batch, job.batch_size):
        grid = BatchGrid.left_padded(group)
        targets = grid.targets(group)
        if len(targets.rows) == 0:
            continue
        select = Select(
            rows=torch.from_numpy(targets.rows), columns=torch.from_numpy(targets.columns), width=grid.width
        )
        attention = torch.from_numpy(grid.real()).long()
        tokens = grid.tokens(group, 0)
        a_record = a_side.forward(tokens, attention, select)
        b_record = b_side.forward(tokens, attention, select)
        tally.add(a_record, b_record, b_side.own(a_record, b_record, select))
        del a_record, b_record
    if tally.tokens == 0:
        raise ProbeError(f"{run.root}: the chosen sequences have no response tokens to compare")
    rows = tally.rows()
    verdict = judge(rows, a_side.ops.reduction, tally.tokens)
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
