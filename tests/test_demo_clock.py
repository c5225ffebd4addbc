"""The demo's step clock (each step's wall time, its table, a failing step timed too), its second process and the
hand-offs between the two."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import REPO
from rich.console import Console

from mismatch_probe.errors import EngineFailure
from mismatch_probe.pipeline.demo.beside import BesideProcess
from mismatch_probe.pipeline.demo.clock import StepClock, _clock
from mismatch_probe.pipeline.demo.handoff import MOE_PASSES, MOE_ROLLOUT, Handoff


def test_steps_are_timed_in_order_and_a_failing_step_is_kept():
    clock = StepClock()
    with clock.step("a"):
        time.sleep(0.05)
    with pytest.raises(RuntimeError), clock.step("b"):
        raise RuntimeError("boom")
    assert [label for label, _ in clock.steps] == ["a", "b"]
    assert 0.05 <= clock.steps[0][1] < 1
    data = clock.as_dict()
    assert [row["step"] for row in data["steps"]] == ["a", "b"]
    assert data["total"] >= data["steps"][0]["seconds"]


def test_clock_format_and_table():
    assert _clock(4.24) == "4.2 s"
    assert _clock(184) == "3 min 04 s"
    clock = StepClock(
        steps=[("moe: generate", 30.0), ("moe: report", 10.0)],
        beside=[("dense: generate", 12.0)],
        started=time.perf_counter() - 40,
    )
    console = Console(width=200, record=True)
    console.print(clock.table())
    text = console.export_text()
    assert "40.0 s in all" in text and "second process's steps ran beside" in text
    rows = [line for line in text.splitlines() if line.startswith("│") and ": " in line]
    assert [row.split()[1] for row in rows] == ["1", "1", "2"]
    assert "30.0 s" in rows[0] and "75%" in rows[0] and "12.0 s" in rows[2] and "30%" in rows[2]
    assert clock.as_dict()["beside"] == [{"step": "dense: generate", "seconds": 12.0}]


def test_a_failing_second_process_is_one_line_naming_it(tmp_path):
    """The second process's ProbeError reaches the first as one line naming that process, its output printed."""
    models = REPO / "mismatch_probe" / "data" / "models"
    beside = BesideProcess.start(tmp_path / "out", models, tmp_path / "missing.jsonl", 2, 4)
    with pytest.raises(EngineFailure, match=r"second process \(dense model.*failed \(exit code 2\): error: .*missing"):
        beside.wait()
    assert not beside.log.parent.exists()  # its temporary output is gone


def test_a_second_process_is_stopped_with_the_first(tmp_path):
    models = REPO / "mismatch_probe" / "data" / "models"
    beside = BesideProcess.start(tmp_path / "out", models, REPO / "mismatch_probe/data/prompts/demo.jsonl", 2, 4)
    beside.stop()
    assert beside.process.returncode is not None and not beside.log.parent.exists()


def test_a_handoff_waits_until_it_is_said(tmp_path):
    handoff = Handoff(folder=tmp_path)
    assert not handoff.said(MOE_ROLLOUT)
    threading.Timer(0.5, handoff.say, args=(MOE_ROLLOUT,)).start()
    start = time.perf_counter()
    handoff.wait(MOE_ROLLOUT, lambda: True, "the writer")
    assert 0.4 <= time.perf_counter() - start < 5 and handoff.said(MOE_ROLLOUT)
    assert not handoff.said(MOE_PASSES)  # each hand-off is its own


def test_a_handoff_whose_writer_ended_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(
        EngineFailure, match=r"^the demo's first process \(MoE model\) ended before moe-rollout was written$"
    ):
        Handoff(folder=tmp_path).wait(MOE_ROLLOUT, lambda: False, "the demo's first process (MoE model)")
    Handoff(folder=tmp_path).say(MOE_PASSES)  # said, then ended: no error
    Handoff(folder=tmp_path).wait(MOE_PASSES, lambda: False, "the second process")


def test_waiting_for_a_second_process_that_failed_is_its_one_line(tmp_path):
    """The first process waits for the second's MoE passes; the second failed first (its prompts are missing):
    the wait ends with the second's own error, not a hang, and its folder is gone."""
    models = REPO / "mismatch_probe" / "data" / "models"
    beside = BesideProcess.start(tmp_path / "out", models, tmp_path / "missing.jsonl", 2, 4)
    try:
        with pytest.raises(EngineFailure, match=r"second process .*failed \(exit code 2\): error: .*missing"):
            beside.wait_for(MOE_PASSES)
    finally:
        beside.stop()
    assert not beside.folder.exists()
