"""Bad input: one line naming the culprit, exit 2, no traceback (SPEC section 8, reliability).

Runs are synthetic (fast) and broken with pyarrow; each case goes through the CLI.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from naive_metrics import naive_metrics, read_side
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.schema import routing_list, routing_matrix
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()
PROBE = [sys.executable, "-m", "mismatch_probe.cli"]
# Two part files per side (samples 0-5 and 6-11), so checks across part boundaries are exercised.
SPEC = SyntheticSpec(n_samples=12, prompt_len=(2, 5), response_len=(3, 9), samples_per_part=6)
SCORES = "scores/synthetic-bf16"
PART0, PART1 = "part-0000000000.parquet", "part-0000000006.parquet"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("bad") / "run", SPEC)


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(result, message: str, prefix: bool = False) -> None:
    """Exit 2, a single `error: MESSAGE` line (or one starting with MESSAGE), no traceback."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # no stray exception
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    if prefix:
        assert errors[0].startswith(f"error: {message}"), result.output
    else:
        assert errors[0] == f"error: {message}", result.output


def edit_column(path: Path, column: str, edit) -> pa.Table:
    """Rewrite one column of a part file with `edit(values)` applied in place; returns the new table."""
    table = pq.read_table(path)
    index = table.schema.get_field_index(column)
    field = table.schema.field(index)
    if pa.types.is_list(field.type):
        col = table.column(column).combine_chunks()
        width = int(np.diff(col.offsets.to_numpy()).max())
        values, valid = routing_matrix(col, width, column)
        values = values.copy()
        edit(values)
        new = routing_list(values, width, valid, field.type.value_type)
    else:
        col = table.column(column).combine_chunks()
        values = col.to_numpy(zero_copy_only=False).copy()
        edit(values)
        new = pa.array(values, type=field.type, mask=col.is_null().to_numpy(zero_copy_only=False))
    table = table.set_column(index, field, new)
    pq.write_table(table, path)
    return table


def row_key(table: pa.Table, i: int) -> tuple[int, int]:
    return table.column("sample_id")[i].as_py(), table.column("position")[i].as_py()


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ---- corrupt and drifted files ------------------------------------------------------------------


def test_truncated_parquet(run):
    part = run / SCORES / PART1
    part.write_bytes(part.read_bytes()[:-100])
    for command in (("report", run), ("gate", run, "--max", "k3_kl=1")):
        assert_refused(
            probe(*command),
            f"{part}: not a readable Parquet file (Parquet magic bytes not found in footer. "
            "Either the file is corrupted or this is not a parquet file.)",
        )


def test_corrupt_data_page(run):
    part = run / "rollout" / PART0
    data = bytearray(part.read_bytes())
    footer = pq.ParquetFile(part).metadata.serialized_size + 8
    data[4:-footer] = bytes(b ^ 0xFF for b in data[4:-footer])  # every page garbled, footer intact
    part.write_bytes(bytes(data))
    assert_refused(probe("report", run), f"{part}: row group 0: corrupt Parquet data (", prefix=True)


def test_wrong_column_type(run):
    part = run / SCORES / PART0
    table = pq.read_table(part)
    i = table.schema.get_field_index("logprob")
    pq.write_table(table.set_column(i, "logprob", table.column(i).cast(pa.float64())), part)
    assert_refused(probe("report", run), f"{part}: column 'logprob' has type double, expected float")


def test_missing_column(run):
    part = run / "rollout" / PART1
    pq.write_table(pq.read_table(part).drop_columns(["token_id"]), part)
    assert_refused(probe("report", run), f"{part}: missing column 'token_id' (expected uint32)")


def test_optional_column_missing_from_one_part(run):
    part = run / SCORES / PART1
    pq.write_table(pq.read_table(part).drop_columns(["top_token_id", "top_logprob"]), part)
    assert_refused(probe("report", run), f"{part}: missing column 'top_token_id' (other parts of this side have it)")


def test_optional_column_missing_from_the_first_part_only(run):
    """Every part's schema counts, not only the first part's: the first part lacking a column others have."""
    part = run / SCORES / PART0
    pq.write_table(pq.read_table(part).drop_columns(["top_token_id", "top_logprob"]), part)
    assert_refused(probe("report", run), f"{part}: missing column 'top_token_id' (other parts of this side have it)")


def test_router_margin_in_some_parts_only(run):
    later = run / SCORES / PART1
    table = pq.read_table(later)
    margins = pa.array([[0.5] * SPEC.num_layers] * table.num_rows, type=pa.list_(pa.float32()))
    pq.write_table(table.append_column("router_margin", margins), later)
    part = run / SCORES / PART0
    assert_refused(probe("report", run), f"{part}: missing column 'router_margin' (other parts of this side have it)")


# ---- sides that do not line up -------------------------------------------------------------------


def test_score_set_covering_fewer_samples(run):
    (run / SCORES / PART1).unlink()
    end = pq.read_table(run / SCORES / PART0).column("position")[-1].as_py()
    message = (
        f"{SCORES}: covers fewer samples than rollout: it ends after sample 5 position "
        f"{end}, while rollout ({PART1}) continues with sample 6 position 0"
    )
    assert_refused(probe("report", run), message)
    assert_refused(probe("gate", run, "--max", "k3_kl=1"), message)


def test_one_token_id_changed(run):
    part = run / SCORES / PART1
    table = edit_column(part, "token_id", lambda v: v.__setitem__(17, v[17] + 1))
    sample, position = row_key(table, 17)
    new = table.column("token_id")[17].as_py()
    assert_refused(
        probe("report", run),
        f"{SCORES} ({PART1}): token_id {new} at sample {sample} position {position} differs from rollout "
        f"({PART1}) token_id {new - 1} at sample {sample} position {position}",
    )


def test_shuffled_rows(run):
    part = run / SCORES / PART0
    table = pq.read_table(part)
    pq.write_table(table.take(np.random.default_rng(1).permutation(table.num_rows)), part)
    sample, position = row_key(pq.read_table(part), 0)
    assert position != 0  # this seed moves a mid-sequence row first
    assert_refused(
        probe("report", run),
        f"{SCORES} ({PART0}) sample {sample} position {position}: row out of order as the first row of the side "
        "(expected rows sorted by sample_id, position, with positions 0, 1, 2... in each sample)",
    )


def test_two_rows_swapped_in_rollout(run):
    part = run / "rollout" / PART0
    table = pq.read_table(part)
    pq.write_table(table.take(np.r_[0, 2, 1, 3 : table.num_rows]), part)
    assert_refused(
        probe("report", run),
        f"rollout ({PART0}) sample 0 position 2: row out of order after sample 0 position 0 "
        "(expected rows sorted by sample_id, position, with positions 0, 1, 2... in each sample)",
    )


def test_sample_repeated_across_parts(run):
    """A sample written twice (e.g. by a botched merge) is refused at the part boundary."""
    first, second = run / SCORES / PART0, run / SCORES / PART1
    table0 = pq.read_table(first)
    last_sample = table0.filter(pa.compute.equal(table0.column("sample_id"), 5))
    pq.write_table(pa.concat_tables([last_sample, pq.read_table(second)]), second)
    end = table0.column("position")[-1].as_py()
    assert_refused(
        probe("report", run),
        f"{SCORES} ({PART1}) sample 5 position 0: row out of order after sample 5 position {end} "
        "(expected rows sorted by sample_id, position, with positions 0, 1, 2... in each sample)",
    )


def test_null_in_a_key_column(run):
    part = run / SCORES / PART1
    table = pq.read_table(part)
    i = table.schema.get_field_index("token_id")
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[[3, 8]] = True
    nulled = pa.array(table.column(i).to_numpy(), type=pa.uint32(), mask=mask)
    pq.write_table(table.set_column(i, pa.field("token_id", pa.uint32(), nullable=True), nulled), part)
    assert_refused(probe("report", run), f"{part}: column 'token_id' has 2 null values, expected none")


def test_uint16_expert_ids_on_one_side_compare_like_uint8(run, tmp_path):
    """The SPEC allows either id width; mixing them must not change a single routing number."""
    assert probe("report", run).exit_code == 0
    want = json.loads((run / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]
    for part in (run / SCORES).glob("part-*.parquet"):
        table = pq.read_table(part)
        i = table.schema.get_field_index("experts")
        wide = table.column(i).cast(pa.list_(pa.uint16()))
        pq.write_table(table.set_column(i, pa.field("experts", wide.type), wide), part)
    result = probe("report", run)
    assert result.exit_code == 0, result.output
    got = json.loads((run / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]
    assert got["router_diff_rate"] > 0 and got == want


# ---- routing that disagrees with the manifest ----------------------------------------------------


def test_experts_width_disagrees_with_manifest(run):
    edit_json(run / "manifest.json", top_k=2)  # the files hold 4 layers x 4 ids
    assert_refused(
        probe("report", run),
        f"{run / 'rollout' / PART0}: column 'experts': row 0 holds 16 values, expected 8",
    )


@pytest.mark.parametrize(
    "typ, width, expected",
    [
        (pa.list_(pa.float32()), 3, ": row 0 holds 3 values, expected 4"),
        (pa.list_(pa.float64()), 4, " has type list<element: double>, expected list<float32>"),
        (pa.list_(pa.float32(), 3), 3, " has width 3, but the manifest says num_layers = 4"),  # format 1
    ],
)
def test_router_margin_column_of_the_wrong_shape(run, typ, width, expected):
    for part in (run / SCORES / PART0, run / SCORES / PART1):
        table = pq.read_table(part)
        margins = pa.array([[0.5] * width] * table.num_rows, type=typ)
        pq.write_table(table.append_column("router_margin", margins), part)
    assert_refused(probe("report", run), f"{run / SCORES / PART0}: column 'router_margin'{expected}")


def test_expert_id_out_of_range(run):
    part = run / SCORES / PART1
    table = edit_column(part, "experts", lambda v: v.__setitem__((9, 5), 16))  # num_experts is 16
    sample, position = row_key(table, 9)
    assert_refused(
        probe("report", run),
        f"{SCORES} ({PART1}) sample {sample} position {position}: expert id 16 >= num_experts 16 (from the run manifest); "
        "`probe doctor` on the run names the engine bug (routes_invalid)",
    )


def test_malformed_manifest_shape(run):
    edit_json(run / "manifest.json", num_experts="16")
    assert_refused(
        probe("report", run), f"{run / 'manifest.json'}: num_experts is '16', expected a non-negative integer"
    )
    edit_json(run / "manifest.json", num_experts=2)
    assert_refused(
        probe("report", run),
        f"{run / 'manifest.json'}: top_k 4 and num_experts 2 do not describe an MoE model (expected 1 <= top_k <= num_experts)",
    )


# ---- log-probabilities ---------------------------------------------------------------------------


def test_positive_logprob(run):
    part = run / SCORES / PART0
    table = pq.read_table(part)
    i = int(np.flatnonzero(table.column("is_response").to_numpy(zero_copy_only=False))[3])
    edit_column(part, "logprob", lambda v: v.__setitem__(i, 0.25))
    sample, position = row_key(table, i)
    assert_refused(
        probe("report", run),
        f"{SCORES} ({PART0}) sample {sample} position {position}: logprob 0.25 > 0, expected a log-probability <= 0",
    )


def test_nonfinite_logprobs_are_counted_not_fatal(tmp_path):
    spec = SyntheticSpec(**{**SPEC.__dict__, "score_sets": (ScoreSetSpec("noisy", nonfinite_fraction=0.2),)})
    root = write_synthetic_run(tmp_path / "run", spec)
    part = root / "rollout" / PART1
    table = pq.read_table(part)
    i = int(np.flatnonzero(table.column("is_response").to_numpy(zero_copy_only=False))[0])
    edit_column(part, "logprob", lambda v: v.__setitem__(i, np.nan))  # one on the reference side too

    result = probe("report", root)
    assert result.exit_code == 0, result.output
    (comp,) = json.loads((root / "report" / "metrics.json").read_text())["comparisons"]
    metrics = comp["metrics"]
    ref, cand = read_side(root / "rollout"), read_side(root / "scores" / "noisy")
    response = [(a["logprob"], b["logprob"]) for a, b in zip(ref, cand) if a["is_response"]]
    nonfinite_cand = sum(not math.isfinite(b) for _, b in response)
    assert nonfinite_cand > 5
    assert metrics["n_nonfinite_cand"] == nonfinite_cand and metrics["n_nonfinite_ref"] == 1
    finite = [(a, b) for a, b in response if math.isfinite(a) and math.isfinite(b)]
    assert metrics["n_tokens"] == len(finite) < metrics["n_response_tokens"] == len(response)
    assert metrics["n_skipped"] == len(response) - len(finite)
    want = naive_metrics(ref, cand, SPEC.num_layers, SPEC.top_k)
    assert math.isfinite(metrics["k3_kl"]) and metrics["k3_kl"] == pytest.approx(want["k3_kl"], rel=1e-6)
    assert metrics["abs_logprob_diff_mean"] == pytest.approx(want["abs_logprob_diff_mean"], rel=1e-6)
    assert (
        f"scores/noisy: {nonfinite_cand} response log-probs are NaN/inf, left out of the means (n_nonfinite_cand)"
        in comp["notes"]
    )
    assert "rollout: 1 response log-probs are NaN/inf, left out of the means (n_nonfinite_ref)" in comp["notes"]
    assert "NaN/inf" in result.output


# ---- empty, missing and mismatched runs ----------------------------------------------------------


def test_empty_run(run):
    for side in ("rollout", SCORES):
        for part in (run / side).glob("part-*.parquet"):
            pq.write_table(pq.read_table(part).slice(0, 0), part)
    assert_refused(probe("report", run), f"{run / 'rollout'}: no rows (empty run)")
    assert_refused(probe("gate", run, "--max", "k3_kl=1"), f"{run / 'rollout'}: no rows (empty run)")


def test_run_without_part_files(run):
    for part in (run / "rollout").glob("part-*.parquet"):
        part.unlink()
    assert_refused(probe("report", run), f"{run / 'rollout'}: no part-*.parquet files (empty or unfinished run)")


def test_manifest_from_another_model(run):
    edit_json(run / SCORES / "manifest.json", config_hash="0123abcd", model="/models/other")
    message = (
        f"{run / SCORES / 'manifest.json'}: config_hash '0123abcd' differs from the rollout manifest's 'synthetic' "
        "(scored with model '/models/other', rollout model 'synthetic')"
    )
    assert_refused(probe("report", run), message)
    assert_refused(probe("gate", run, "--max", "k3_kl=1"), message)


def test_score_set_at_another_temperature(run):
    edit_json(run / SCORES / "manifest.json", temperature=0.7)
    assert_refused(
        probe("report", run),
        f"{run / SCORES / 'manifest.json'}: temperature 0.7 differs from the rollout manifest's scoring_temperature 1.0",
    )


def test_unfinished_score_set(run):
    edit_json(run / SCORES / "manifest.json", status="running")
    assert_refused(
        probe("report", run),
        f"{run / SCORES / 'manifest.json'}: score set is unfinished (status 'running'); "
        f"finish it with `probe rescore {run} --resume`",
    )


def test_missing_manifests(run):
    (run / SCORES / "manifest.json").unlink()
    assert_refused(
        probe("report", run),
        f"{run / SCORES / 'manifest.json'}: file not found (score set 'synthetic-bf16' has part files but no manifest)",
    )
    (run / "manifest.json").unlink()
    assert_refused(probe("report", run), f"{run / 'manifest.json'}: file not found")
    assert_refused(probe("gate", run, "--max", "k3_kl=1"), f"{run / 'manifest.json'}: file not found")


def test_manifest_not_an_object(run):
    (run / "manifest.json").write_text("[1, 2]")
    assert_refused(probe("report", run), f"{run / 'manifest.json'}: expected a JSON object, found list")


# ---- outputs that cannot be written --------------------------------------------------------------


def test_report_folder_is_a_file(run):
    (run / "report").write_text("not a folder")  # works as root too, unlike chmod
    assert_refused(
        probe("report", run), f"{run / 'report'}: exists and is not a directory; cannot write the report there"
    )


def test_report_folder_under_a_file(run, tmp_path):
    """Nothing can be created under a regular file, root or not."""
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    broken = blocker / "run"
    with pytest.raises(NotADirectoryError):
        broken.mkdir()
    assert_refused(
        probe("gate", run, "--max", "k3_kl=1", "--junit", broken / "gate.xml"),
        f"{broken / 'gate.xml'}: cannot write JUnit XML (Not a directory)",
    )


def test_gate_metrics_json_with_bad_values(run):
    (run / "report").mkdir()
    path = run / "report" / "metrics.json"
    path.write_text(json.dumps({"schema_version": 1, "comparisons": [{"reference": "rollout"}]}))
    assert_refused(
        probe("gate", run, "--max", "k3_kl=1"),
        f"{path}: comparisons[0]: expected {{'reference': ..., 'candidate': ..., 'metrics': {{...}}}}",
    )
    comp = {"reference": "rollout", "candidate": SCORES, "metrics": {"k3_kl": "low"}}
    path.write_text(json.dumps({"schema_version": 1, "comparisons": [comp]}))
    assert_refused(
        probe("gate", run, "--max", "k3_kl=1"),
        f"{path}: rollout vs {SCORES}: k3_kl is 'low', expected a number or null",
    )


# ---- the real process: stderr, exit code, --debug ------------------------------------------------


def test_subprocess_one_line_and_debug_traceback(run):
    part = run / SCORES / PART0
    part.write_bytes(b"PAR1 not really")
    plain = subprocess.run([*PROBE, "report", str(run)], capture_output=True, text=True)
    assert plain.returncode == 2
    (line,) = plain.stderr.strip().splitlines()
    assert line.startswith(f"error: {part}: not a readable Parquet file ("), plain.stderr
    assert "Traceback" not in plain.stderr + plain.stdout
    debug = subprocess.run([*PROBE, "--debug", "report", str(run)], capture_output=True, text=True)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "ProbeError" in debug.stderr


# ---- rescore reads the rollout with the same checks ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_rollout(tmp_path_factory, tiny_moe) -> Path:
    prompts = tmp_path_factory.mktemp("p") / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 5, 7]}) for i in range(4)) + "\n")
    root = tmp_path_factory.mktemp("tiny") / "run"
    result = probe(
        "generate",
        "--model",
        tiny_moe,
        "--prompts",
        prompts,
        "--out",
        root,
        "--max-new-tokens",
        4,
        "--batch-size",
        2,
        "--seed",
        1,
    )
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def rollout_copy(tiny_rollout, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_rollout, tmp_path / "run"))


def test_rescore_refuses_broken_rollouts(rollout_copy):
    run = rollout_copy
    part = run / "rollout" / "part-0000000002.parquet"
    good = part.read_bytes()

    table = pq.read_table(part)
    pq.write_table(table.take(np.r_[1, 0, 2 : table.num_rows]), part)
    assert_refused(
        probe("rescore", run),
        f"{part}: row 0: sample 2 has position 1, expected 0 (rows must be sorted by sample_id, position, with no gaps)",
    )

    shutil.rmtree(run / "scores")  # the parts before the bad one were scored
    part.write_bytes(good)
    table = edit_column(part, "experts", lambda v: v.__setitem__((2, 1), 8))  # 8 experts: ids 0..7
    assert_refused(
        probe("rescore", run, "--replay", "r3"),
        f"{part}: column 'experts': sample {table.column('sample_id')[2].as_py()} has an expert id >= num_experts (8)",
    )

    shutil.rmtree(run / "scores")
    table = pq.read_table(io.BytesIO(good))
    experts = table.column("experts")
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("experts"), table.schema.field("experts"), pa.nulls(len(table), experts.type)
        ),
        part,
    )  # a rollout without routing
    n = table.column("sample_id").to_pylist().count(table.column("sample_id")[0].as_py())
    assert_refused(
        probe("rescore", run, "--replay", "r3"),
        f"{part}: sample {table.column('sample_id')[0].as_py()}: replay asked for, but the rollout has routed experts "
        f"for none of its {n} positions (the inference engine returned no routing; rescore without --replay r3)",
    )

    shutil.rmtree(run / "scores")
    part.write_bytes(good)
    pq.write_table(pq.read_table(part).slice(0, 0), part)
    assert_refused(probe("rescore", run), f"{part}: no rows (expected at least one sequence per part file)")

    shutil.rmtree(run / "scores")
    part.write_bytes(good[: len(good) // 2])
    assert_refused(
        probe("rescore", run),
        f"{part}: not a readable Parquet file (Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file.)",
    )
    assert not (run / "scores").exists()  # footers are checked before anything is written


def test_rescore_refuses_unfinished_or_foreign_manifests(rollout_copy):
    run = rollout_copy
    manifest = run / "manifest.json"
    edit_json(manifest, status="running")
    assert_refused(
        probe("rescore", run),
        f"{manifest}: the rollout is unfinished (status 'running'); finish it with `probe generate ... --resume`",
    )
    data = json.loads(manifest.read_text())
    data["status"] = "complete"
    del data["scoring_temperature"]
    manifest.write_text(json.dumps(data))
    assert_refused(
        probe("rescore", run),
        f"{manifest}: missing 'scoring_temperature' (expected a rollout manifest written by `probe generate`)",
    )


# ---- Ctrl-C ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_exits_130_and_resumes(tiny_moe, tmp_path):
    samples = 10
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 7, 9]}) for i in range(samples)) + "\n")
    out = tmp_path / "run"
    cmd = [
        *PROBE,
        "generate",
        "--model",
        str(tiny_moe),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "16",
        "--batch-size",
        "1",
        "--seed",
        "3",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while len(list((out / "rollout").glob("part-*.parquet"))) < 2:
        assert proc.poll() is None, "finished before it could be interrupted"
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted: finished parts are kept; re-run with --resume to continue" in stderr
    assert "Traceback" not in stdout + stderr
    parts = list((out / "rollout").glob("part-*.parquet"))
    assert 2 <= len(parts) < samples, "the interrupt came too late to test anything"
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"

    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    table = pa.concat_tables([pq.read_table(p) for p in sorted((out / "rollout").glob("part-*.parquet"))])
    assert sorted(set(table.column("sample_id").to_pylist())) == list(range(samples))
    keys = list(zip(table.column("sample_id").to_pylist(), table.column("position").to_pylist()))
    assert keys == sorted(set(keys))  # ordered, nothing doubled
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
