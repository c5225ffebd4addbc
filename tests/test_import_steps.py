"""A folder of per-step dumps imports into one run with its steps (issue 34): verl's DataProto per step,
slime's {rollout_id}.pt (and its --dump-details layout), prime-rl's step_N/, each with 3 steps; the manifest's
ranges and both sides' step column say which step each sample came from, and the report splits by them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from import_dumps import make_seqs, write_prime_rl, write_slime_rollout, write_slime_train, write_verl_step
from typer.testing import CliRunner

from mismatch_probe.cli import app

FIXTURES = Path(__file__).parent / "fixtures" / "import"
STEPS = (2, 9, 10)  # 10 after 9: per-step files are read in numeric order, not name order
runner = CliRunner()


def probe(*argv):
    return runner.invoke(app, [str(a) for a in argv], catch_exceptions=False)


def verl_folder(root: Path) -> tuple[Path, list[int]]:
    for step in STEPS:
        write_verl_step(FIXTURES / "verl_step1.pkl", root / f"step_{step}.pkl", step)
    return root, [3, 3, 3]  # the fixture's batch holds 3 samples


def slime_folder(root: Path) -> tuple[Path, list[int]]:
    for i, step in enumerate(STEPS):
        write_slime_train(root / f"{step}.pt", make_seqs(n=2 + i, seed=i), rollout_id=None)  # the name gives it
    return root, [2, 3, 4]


def slime_dump_details(root: Path) -> tuple[Path, list[int]]:
    """`--dump-details DIR`: rollout_data/{id}.pt (no training log-probs) beside train_data/{id}.pt."""
    for i, step in enumerate(STEPS):
        seqs = make_seqs(n=2 + i, seed=i)
        write_slime_rollout(root / "rollout_data" / f"{step}.pt", seqs)
        write_slime_train(root / "train_data" / f"{step}.pt", seqs, rollout_id=step)
    return root, [2, 3, 4]


def prime_rl_folder(root: Path) -> tuple[Path, list[int]]:
    for i, step in enumerate(STEPS):
        write_prime_rl(root, make_seqs(n=2 + i, seed=i), step=step)
    return root, [2, 3, 4]


FOLDERS = {
    "verl": ("verl", verl_folder),
    "slime": ("slime", slime_folder),
    "slime --dump-details": ("slime", slime_dump_details),
    "prime-rl": ("prime-rl", prime_rl_folder),
}


@pytest.mark.parametrize("case", sorted(FOLDERS))
def test_a_folder_of_per_step_dumps_imports_with_its_steps(tmp_path, case):
    fmt, make = FOLDERS[case]
    dump, per_step = make(tmp_path / "dump")
    result = probe("import", fmt, dump, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    ends = np.cumsum(per_step)
    want = [[step, int(end - n), int(end - 1)] for step, n, end in zip(STEPS, per_step, ends)]
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["steps"] == want
    for side in ("rollout", "scores/training"):
        table = pq.ParquetDataset(sorted((tmp_path / "run" / side).glob("part-*.parquet"))).read()
        sample, step = table.column("sample_id").to_numpy(), table.column("step").to_numpy()
        for s, first, last in want:
            assert (step[(sample >= first) & (sample <= last)] == s).all()
    assert probe("report", tmp_path / "run").exit_code == 0
    comparison = json.loads((tmp_path / "run" / "report" / "metrics.json").read_text())["comparisons"][0]
    assert [s["step"] for s in comparison["steps"]] == list(STEPS)
    assert sum(s["n_tokens"] for s in comparison["steps"]) == comparison["metrics"]["n_tokens"]


def test_a_score_set_added_by_rescore_carries_the_step_column(tmp_path):
    from conftest import DEMO_MOE

    for i, step in enumerate((4, 5)):
        seqs = make_seqs(n=2, seed=i, layers=4, experts=16, vocab=512)  # the demo MoE's shape and vocabulary
        write_slime_train(tmp_path / "dump" / f"{step}.pt", seqs, rollout_id=step)
    run = tmp_path / "run"
    assert (
        probe("import", "slime", tmp_path / "dump", "--out", run, "--model", DEMO_MOE, "--temperature", "1").exit_code
        == 0
    )
    rescore = probe("rescore", run, "--engine", "hf", "--dtype", "fp32")
    assert rescore.exit_code == 0, rescore.output
    table = pq.ParquetDataset(sorted((run / "scores" / "hf-fp32").glob("part-*.parquet"))).read()
    sample, step = table.column("sample_id").to_numpy(), table.column("step").to_numpy()
    assert (step[sample < 2] == 4).all() and (step[sample >= 2] == 5).all()
