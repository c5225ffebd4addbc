"""`probe import` per dump format and the Recorder: an ordinary run that `probe report` and `gate` read,
with metrics equal to a direct computation from the dumped arrays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from import_dumps import (
    LAYERS,
    TOP_K,
    Seq,
    k3_of,
    make_seqs,
    write_miles,
    write_nemo_rl,
    write_prime_rl,
    write_slime_rollout,
    write_slime_train,
)
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.errors import ProbeError
from mismatch_probe.record import Recorder
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.logged import TRAINING_SIDE

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures" / "import"
WRITERS = {
    "slime": (lambda root, seqs: write_slime_train(root / "train_data" / "3.pt", seqs), True),
    "miles": (write_miles, True),
    "prime-rl": (write_prime_rl, False),
    "nemo-rl": (write_nemo_rl, False),
}


def probe(*argv: str):
    return runner.invoke(app, [str(a) for a in argv], catch_exceptions=False)


def table(directory: Path):
    return (
        pq.ParquetDataset(sorted(directory.glob("part-*.parquet")))
        .read()
        .sort_by([("sample_id", "ascending"), ("position", "ascending")])
    )


def metrics_of(run: Path) -> dict:
    result = probe("report", run)
    assert result.exit_code == 0, result.output
    comparison = json.loads((run / "report" / "metrics.json").read_text())["comparisons"][0]
    assert (comparison["reference"], comparison["candidate"]) == ("rollout", f"scores/{TRAINING_SIDE}")
    return comparison["metrics"]


def check_tables(run: Path, seqs, routed: bool) -> None:
    rollout, training = table(run / "rollout"), table(run / "scores" / TRAINING_SIDE)
    for side, lp in ((rollout, "inference"), (training, "training")):
        sample = side.column("sample_id").to_numpy()
        for i, s in enumerate(seqs):
            rows = side.filter(sample == i)
            assert rows.column("token_id").to_pylist() == np.concatenate([s.prompt, s.response]).tolist()
            assert rows.column("is_response").to_pylist() == [False] * len(s.prompt) + [True] * len(s.response)
            expected = [None] * len(s.prompt) + [float(v) if m else None for v, m in zip(getattr(s, lp), s.mask)]
            assert rows.column("logprob").to_pylist() == pytest.approx(expected)
    experts = rollout.column("experts")
    if routed:
        first = rollout.filter(rollout.column("sample_id").to_numpy() == 0)
        got = np.array(first.column("experts").to_pylist()[: len(seqs[0].experts)]).reshape(-1, LAYERS, TOP_K)
        assert (got == seqs[0].experts).all()
        assert first.column("experts").to_pylist()[-1] is None  # the last position has no routing (not forwarded)
    else:
        assert experts.null_count == len(experts)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_import_then_report_gives_the_dump_k3(tmp_path, fmt):
    write, routed = WRITERS[fmt]
    seqs = make_seqs()
    dump = write(tmp_path / "dump", seqs)
    result = probe("import", fmt, dump, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert f"imported {len(seqs)} samples" in result.output
    check_tables(tmp_path / "run", seqs, routed)
    metrics = metrics_of(tmp_path / "run")
    assert metrics["n_tokens"] == sum(int(s.mask.sum()) for s in seqs)
    assert metrics["k3_kl"] == pytest.approx(k3_of(seqs), rel=1e-5)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["source"]["format"] == fmt
    assert manifest["scoring_temperature"] is None and manifest["model"] is None
    if routed:
        assert (manifest["num_layers"], manifest["top_k"]) == (LAYERS, TOP_K)
    else:
        assert "routed experts: not in the source; routing comparisons cannot be made" in result.output
    assert probe("gate", tmp_path / "run", "--max", "k3_kl=10").exit_code == 0


def test_verl_dump_written_by_verl_imports_without_verl(tmp_path):
    """The fixture is verl's own DataProto.save_to_disk; the answer is what verl read back from it."""
    expected = json.loads((FIXTURES / "verl_step1.expected.json").read_text())
    result = probe("import", "verl", FIXTURES / "verl_step1.pkl", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    rollout, training = table(tmp_path / "run" / "rollout"), table(tmp_path / "run" / "scores" / TRAINING_SIDE)
    for i, row in enumerate(expected):
        mine = rollout.filter(rollout.column("sample_id").to_numpy() == i)
        theirs = training.filter(training.column("sample_id").to_numpy() == i)
        assert mine.column("token_id").to_pylist() == row["prompt_ids"] + row["response_ids"]
        p = len(row["prompt_ids"])
        assert mine.column("logprob").to_pylist()[p:] == pytest.approx(row["inference_logprobs"])
        assert theirs.column("logprob").to_pylist()[p:] == pytest.approx(row["training_logprobs"])
        routed = mine.column("experts").to_pylist()
        # verl zero-fills the last position (the server returns none for it): stored as no routing
        assert np.array(routed[:-1]).reshape(-1, 2, 2).tolist() == row["routed_experts"][:-1]
        assert routed[-1] is None and row["routed_experts"][-1] == [[0, 0], [0, 0]]
    d = np.concatenate([np.subtract(r["training_logprobs"], r["inference_logprobs"]) for r in expected])
    metrics = metrics_of(tmp_path / "run")
    assert metrics["k3_kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-5)
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["steps"] == [[1, 0, 2]]


def test_slime_rollout_dump_says_the_training_side_is_missing(tmp_path):
    dump = write_slime_rollout(tmp_path / "rollout_data" / "3.pt", make_seqs())
    result = probe("import", "slime", dump, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "holds no training log-probs ('log_probs')" in result.output
    assert "rollout-vs-training comparison cannot be made" in result.output


def test_missing_field_names_the_line_and_field(tmp_path):
    root = write_prime_rl(tmp_path / "dump", make_seqs(n=3))
    path = root / "token_exports" / "step_1" / "rank_0.jsonl"
    lines = path.read_text().splitlines()
    broken = json.loads(lines[1])
    del broken["trainer_logprobs"]
    path.write_text("\n".join([lines[0], json.dumps(broken), lines[2]]) + "\n")
    result = probe("import", "prime-rl", root, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert f"{path}:2: missing field 'trainer_logprobs'" in " ".join(result.output.split())


def test_miles_context_parallel_dump_is_refused(tmp_path):
    root = write_miles(tmp_path / "dump", make_seqs(n=2), cp_size=2)
    result = probe("import", "miles", root, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "cp_size 2" in result.output


def test_import_never_replaces_a_users_folder(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    dump = write_nemo_rl(tmp_path / "dump", make_seqs(n=2))
    for extra in ([], ["--overwrite"]):
        result = probe("import", "nemo-rl", dump, "--out", out, *extra)
        assert result.exit_code == 2
    assert (out / "notes.txt").read_text() == "keep me"
    assert probe("import", "nemo-rl", dump, "--out", tmp_path / "run").exit_code == 0
    assert probe("import", "nemo-rl", dump, "--out", tmp_path / "run", "--overwrite").exit_code == 0


def test_a_non_empty_out_is_named_without_a_resume_option(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    dump = write_nemo_rl(tmp_path / "dump", make_seqs(n=2))
    result = probe("import", "nemo-rl", dump, "--out", tmp_path / "mine")
    assert result.exit_code == 2 and "mine: not empty" in result.output and "--resume" not in result.output
    with pytest.raises(ProbeError, match="not empty"):
        Recorder(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---- Recorder -----------------------------------------------------------------------------------


def test_recorder_run_reads_back_and_reports(tmp_path):
    import torch

    seqs = make_seqs(n=6, masked_token=False)
    with Recorder(tmp_path / "run", part_tokens=10) as rec:  # several parts
        for step, s in enumerate(seqs):
            rec.add(
                torch.from_numpy(s.prompt),
                s.response.tolist(),
                torch.from_numpy(s.inference),
                s.training,
                routed_experts=s.experts,
                step=step // 2,
            )
    assert len(list((tmp_path / "run" / "rollout").glob("part-*.parquet"))) > 1
    check_tables(tmp_path / "run", seqs, routed=True)
    assert metrics_of(tmp_path / "run")["k3_kl"] == pytest.approx(k3_of(seqs), rel=1e-5)
    manifest = Run(tmp_path / "run").manifest()
    assert manifest.status == "complete" and manifest.extra["steps"] == [[0, 0, 1], [1, 2, 3], [2, 4, 5]]


def test_recorder_closes_cleanly_on_an_exception(tmp_path):
    seqs = make_seqs(n=4, masked_token=False)
    with pytest.raises(ZeroDivisionError):
        with Recorder(tmp_path / "run") as rec:
            for i, s in enumerate(seqs):
                rec.add(s.prompt, s.response, s.inference, s.training)
                if i == 2:
                    1 / 0  # noqa: B018 - the training loop fails mid-way
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["completed_samples"] == 3
    assert manifest["interrupted"].startswith("writing stopped by ZeroDivisionError")
    assert metrics_of(tmp_path / "run")["k3_kl"] == pytest.approx(k3_of(seqs[:3]), rel=1e-5)


def test_recorder_rejects_misaligned_logprobs(tmp_path):
    s = make_seqs(n=1)[0]
    with Recorder(tmp_path / "run") as rec:
        with pytest.raises(ProbeError, match=r"sample 0: training log-probs has \d+ values, expected \d+"):
            rec.add(s.prompt, s.response, s.inference, s.training[:-1])


PEAK = """
import sys, numpy as np
from mismatch_probe.record import Recorder
n, seq = int(sys.argv[1]), 512
rng = np.random.default_rng(0)
lp = -rng.exponential(1.0, seq - 64).astype(np.float32)
with Recorder(sys.argv[2], part_tokens=1 << 16) as rec:
    for i in range(n // seq):
        rec.add(np.arange(64), np.arange(seq - 64), lp, lp * 1.01)
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")))
"""


def _peak_kib(tmp_path: Path, script: str, *args) -> int:
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_recorder_memory_is_bounded(tmp_path):
    small = _peak_kib(tmp_path, PEAK, 200_000, tmp_path / "small")
    large = _peak_kib(tmp_path, PEAK, 1_600_000, tmp_path / "large")
    assert large - small < 20_000, (small, large)  # 8x the tokens, under 20 MB more peak memory


IMPORT_PEAK = """
import sys
import mismatch_probe.rundir.logged as logged
logged.PART_TOKENS = 1 << 16
from mismatch_probe.importers import DumpFormat
from mismatch_probe.importers.job import ImportJob, run_import
from pathlib import Path
run_import(ImportJob(format=DumpFormat.prime_rl, path=Path(sys.argv[1]), out=Path(sys.argv[2])))
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")))
"""


def test_jsonl_import_streams(tmp_path):
    r = np.full(448, -0.5, dtype=np.float32)
    one = Seq(prompt=np.arange(64), response=np.arange(448), inference=r, training=r, mask=r < 0, experts=None)
    peaks = []
    for name, lines in (("small", 200), ("large", 1600)):  # 100K and 800K tokens, parts of 64K
        path = write_prime_rl(tmp_path / name, [one])
        text = (path / "token_exports" / "step_1" / "rank_0.jsonl").read_text()
        (path / "token_exports" / "step_1" / "rank_0.jsonl").write_text(text * lines)
        peaks.append(_peak_kib(tmp_path, IMPORT_PEAK, path, tmp_path / f"run-{name}"))
    assert peaks[1] - peaks[0] < 15_000, peaks  # 8x the tokens, under 15 MB more peak memory


def test_verl_example_in_the_docs_records_verls_batch(tmp_path, monkeypatch):
    """docs/record.md's verl snippet, run on a real DataProto (where verl and tensordict are installed)."""
    pytest.importorskip("tensordict")
    pytest.importorskip("verl.protocol")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_verl_fixture", FIXTURES.parents[2] / "scripts" / "make_verl_fixture.py"
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    snippet = (FIXTURES.parents[2] / "docs" / "record.md").read_text().split("```python\n")[2].split("```")[0]
    monkeypatch.chdir(tmp_path)
    namespace = {"batch": maker.build(), "recorder": None}
    exec(snippet, namespace)  # noqa: S102 - the documented example itself
    namespace["recorder"].close()
    expected = json.loads((FIXTURES / "verl_step1.expected.json").read_text())
    d = np.concatenate([np.subtract(r["training_logprobs"], r["inference_logprobs"]) for r in expected])
    metrics = metrics_of(tmp_path / "runs" / "verl-mismatch")
    assert metrics["k3_kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-5)
    rollout = table(tmp_path / "runs" / "verl-mismatch" / "rollout")
    routed = np.array([e is not None for e in rollout.column("experts").to_pylist()])
    assert routed.sum() == sum(len(r["prompt_ids"]) + len(r["response_ids"]) - 1 for r in expected)


def test_nemo_rl_skipped_policy_logprobs_are_refused(tmp_path):
    """force_on_policy_ratio makes NeMo-RL write zeros as prev_logprobs: no training side to compare."""
    seqs = make_seqs(n=2)
    for s in seqs:
        s.training = np.zeros_like(s.training)
    result = probe("import", "nemo-rl", write_nemo_rl(tmp_path / "dump", seqs), "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert "prev_logprobs are all zero" in result.output and "training side is missing" in result.output


@pytest.mark.parametrize(
    ("fmt", "content", "message"),
    [
        ("verl", b"not a pickle", "not a verl DataProto dump"),
        ("slime", None, "no 'samples' list (expected a slime debug dump)"),
        ("slime", b"not a pickle", "3.pt: not a readable torch dump"),
        ("nemo-rl", b"{not json\n", "not valid JSON"),
    ],
)
def test_unreadable_dump_is_one_line(tmp_path, fmt, content, message):
    import torch

    name = {"verl": "step.pkl", "slime": "3.pt", "nemo-rl": "train_data_step1.jsonl"}[fmt]
    path = tmp_path / name
    if content is None:
        torch.save({"rollout_id": 3}, path)
    else:
        path.write_bytes(content)
    result = probe("import", fmt, path, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing written: a retry needs no --overwrite


def test_absent_dump_is_one_line(tmp_path):
    result = probe("import", "prime-rl", tmp_path / "nowhere", "--out", tmp_path / "run")
    assert result.exit_code == 2 and "nowhere: not found" in result.output
    assert not (tmp_path / "run").exists()


def test_import_with_the_model_named_can_be_rescored(tmp_path):
    """--model gives the manifest the model's config hash and routing shape, so `probe rescore` adds a
    score set to the imported run (here with R3: the dump's routing replayed) and report compares all three."""
    from conftest import DEMO_MOE

    seqs = make_seqs(n=3, layers=4, experts=16, vocab=512)  # the demo MoE: 4 MoE layers, top-2 of 16, 512 tokens
    dump = write_slime_train(tmp_path / "3.pt", seqs)
    run = tmp_path / "run"
    result = probe("import", "slime", dump, "--out", run, "--model", DEMO_MOE, "--temperature", "1.0")
    assert result.exit_code == 0, result.output
    assert "num_experts: not in the source" not in result.output and "temperature: not" not in result.output
    manifest = Run(run).manifest()
    assert (manifest.model, manifest.num_experts, manifest.scoring_temperature) == (str(DEMO_MOE), 16, 1.0)
    rescore = probe("rescore", run, "--engine", "hf", "--dtype", "fp32", "--replay", "r3")
    assert rescore.exit_code == 0, rescore.output
    assert probe("report", run).exit_code == 0
    comparisons = json.loads((run / "report" / "metrics.json").read_text())["comparisons"]
    metrics = {c["candidate"]: c["metrics"] for c in comparisons}
    assert sorted(metrics) == ["scores/hf-fp32-r3", "scores/training"]
    assert metrics["scores/training"]["k3_kl"] == pytest.approx(k3_of(seqs), rel=1e-5)
    # R3 fed the dump's routing to the model: the replayed positions route exactly as dumped
    assert metrics["scores/hf-fp32-r3"]["router_diff_rate"] == 0.0


def test_token_outside_the_named_models_vocabulary_is_refused(tmp_path):
    from conftest import DEMO_MOE

    dump = write_prime_rl(tmp_path / "dump", make_seqs(n=2, vocab=1000, seed=3))
    result = probe("import", "prime-rl", dump, "--out", tmp_path / "run", "--model", DEMO_MOE)
    assert result.exit_code == 2 and "out of range (expected 0 <= id < 512)" in result.output


KILLED = """
import os, sys, numpy as np
from mismatch_probe.record import Recorder
rec = Recorder(sys.argv[1], part_tokens=100)
for i in range(10):
    rec.add(np.arange(20), np.arange(30), np.full(30, -0.5), np.full(30, -0.6))
os._exit(1)  # killed: no close, no exception handler
"""


def test_a_killed_recording_leaves_finished_parts_and_a_clear_line(tmp_path):
    subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / "run")], check=False)
    parts = sorted((tmp_path / "run" / "rollout").glob("part-*.parquet"))
    assert parts and pq.read_table(parts[0]).num_rows > 0  # what was flushed is readable Parquet
    result = probe("report", tmp_path / "run")
    assert result.exit_code == 2
    assert "unfinished: the recorder writer stopped before closing" in " ".join(result.output.split())


def test_verl_batch_without_the_actors_logprobs_names_the_key(tmp_path):
    from mismatch_probe.errors import ProbeError
    from mismatch_probe.importers.verl import load_batch, samples_of

    batch, meta = load_batch(FIXTURES / "verl_step1.pkl")
    del batch["old_log_probs"]
    with pytest.raises(ProbeError, match=r"verl_step1.pkl: batch has no 'old_log_probs' \(the actor's log-probs\)"):
        next(samples_of(batch, meta, FIXTURES / "verl_step1.pkl"))


def test_verl_zero_filled_routing_rows_are_no_routing():
    from mismatch_probe.importers.verl import routed_rows

    rows = np.array([[[1, 2]], [[3, 0]], [[0, 0]], [[0, 0]]])  # top-2: the last two are verl's filling
    assert routed_rows(rows).tolist() == [[[1, 2]], [[3, 0]]]
    single = np.array([[[0]], [[4]], [[0]], [[0]]])  # top-1: expert 0 is real; only the last row is filling
    assert routed_rows(single).tolist() == [[[0]], [[4]], [[0]]]
