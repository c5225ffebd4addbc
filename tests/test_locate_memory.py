"""`probe locate` holds one configuration at a time: side a runs and is freed before side b loads, a's records
kept on disk in between, and every row it reports is the one the comparison with both sides loaded at once
gives (that loop, written out here, on the very batches locate made), bit for bit."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from mismatch_probe.locate import job as locate_job
from mismatch_probe.locate import side as locate_side
from mismatch_probe.locate.measures import Tally
from mismatch_probe.locate.rule import judge
from tests.conftest import DEMO_MOE, DEMO_PROMPTS
from tests.test_diagnose import probe


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("locate-memory") / "run"
    args = ["--num-prompts", 4, "--max-new-tokens", 8, "--seed", 5, "--dtype", "bf16"]
    assert probe("generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", out, *args).exit_code == 0
    return out


def both_loaded(a_spec, a_info, b_spec, b_info, batches):
    """The comparison as it was made with both sides loaded: per batch a's forward, b's, b's own on a's record."""
    a_side, b_side = locate_job._side(a_spec, a_info), locate_job._side(b_spec, b_info)
    tally = Tally()
    for tokens, attention, select in batches:
        a = a_side.forward(tokens, attention, select)
        b = b_side.forward(tokens, attention, select)
        tally.add(a, b, b_side.own(a, b, select))
    return tally.rows(), judge(tally.rows(), a_side.ops.reduction, tally.tokens), tally.tokens


@pytest.mark.parametrize("a, b", [("hf:bf16", "hf:fp32"), ("hf:fp32", "hf:bf16:router_dtype=fp32")])
def test_one_side_at_a_time_gives_the_rows_of_both_at_once(run, monkeypatch, a, b):
    seen, alive_at_load = {}, []
    loaded: list[weakref.ref] = []
    original_a, original_load = locate_job._run_a, locate_side.load_training_model

    def run_a(spec, info, batches, spill):
        seen["a"], seen["batches"] = (spec, info), batches
        return original_a(spec, info, batches, spill)

    def load(*args, **kwargs):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in loaded))
        engine = original_load(*args, **kwargs)
        loaded.append(weakref.ref(engine.hf))
        return engine

    monkeypatch.setattr(locate_job, "_run_a", run_a)
    monkeypatch.setattr(locate_side, "load_training_model", load)
    result = locate_job.run_locate(
        locate_job.LocateJob(run=run, a=a, b=b, worst=0, samples=4, batch_size=2, quiet=True)
    )
    assert alive_at_load == [0, 0]  # side b loaded with side a's model freed
    assert len(seen["batches"]) == 2 and not (run / "locate" / ".side-a").exists()
    monkeypatch.setattr(locate_side, "load_training_model", original_load)
    rows, verdict, tokens = both_loaded(
        *seen["a"], result.sides.b, locate_job._model(result.sides.b, None), seen["batches"]
    )
    assert [r.to_json() for r in result.rows] == [r.to_json() for r in rows]
    assert (result.verdict.sentence, result.tokens) == (verdict.sentence, tokens)
    assert any(r.own > 0 for r in rows)  # the two configurations differ: the equality is not of zeros
