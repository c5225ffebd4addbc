"""`probe report` end to end on synthetic runs: files written, and bad input refused with exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.report.stream.comparison import ROUTING_KEYS
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(n_samples=12, prompt_len=(2, 5), response_len=(3, 9))


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    spec = SyntheticSpec(
        **SMALL,
        score_sets=(
            ScoreSetSpec("bf16", logprob_sigma=0.05),
            ScoreSetSpec("r3", replay="r3", route_fraction=0.0),
            ScoreSetSpec("rep1", repeat_group="rep", pass_index=1),
            ScoreSetSpec("rep2", repeat_group="rep", pass_index=2),
        ),
    )
    return write_synthetic_run(tmp_path_factory.mktemp("moe") / "run", spec)


def test_report_writes_metrics_plots_and_html(moe_run):
    result = run_cli("report", moe_run)
    assert result.exit_code == 0, result.output
    assert "index.html" in result.output and "k3 KL [95% interval]" in result.output
    report = moe_run / "report"
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["schema_version"] == 1
    pairs = [(c["reference"], c["candidate"]) for c in metrics["comparisons"]]
    assert pairs == [
        ("rollout", "scores/bf16"),
        ("rollout", "scores/r3"),
        ("rollout", "scores/rep1"),
        ("rollout", "scores/rep2"),
        ("scores/rep1", "scores/rep2"),
    ]
    for comp in metrics["comparisons"]:
        assert set(comp) >= {"reference", "candidate", "metrics"}
        flat = {k: v for k, v in comp["metrics"].items() if not k.endswith("_ci95")}
        assert all(not isinstance(v, (dict, list)) for v in flat.values())  # flat, but for [low, high] intervals
        assert comp["metrics"]["n_tokens"] > 0 and comp["metrics"]["router_diff_rate"] is not None
    r3 = metrics["comparisons"][1]["metrics"]
    assert r3["router_diff_rate"] == 0 and r3["token_diff_rate"] == 0
    assert not list(report.glob("*.png"))  # one self-contained page
    html = (report / "index.html").read_text()
    figures = re.findall(r'<figure class="(\w+)"><svg', html)
    # per comparison a scatter and the breakdowns; routing forensics only where routing was not replayed
    assert sorted(figures) == ["breakdown"] * 5 + ["forensics"] * 4 + ["scatter"] * 5
    r3_card = html[html.index('id="comparison-1"') : html.index("</section>", html.index('id="comparison-1"'))]
    assert "routing replayed: identical by construction" in r3_card and '<figure class="forensics">' not in r3_card
    # F(t) of no R3 vs rollout, of training vs training and of R3; the three routing levels
    assert "<img " not in html and html.count("<svg") == len(figures) + 3 + 3
    assert "scores/rep1" in html and "synthetic" in html and "temperature" in html


def test_report_pair_option_and_thresholds(moe_run):
    result = run_cli("report", moe_run, "--pair", "scores/rep2:rep1", "--thresholds", "3,2.50")
    assert result.exit_code == 0, result.output
    metrics = json.loads((moe_run / "report" / "metrics.json").read_text())
    (comp,) = metrics["comparisons"]
    assert (comp["reference"], comp["candidate"]) == ("scores/rep2", "scores/rep1")
    extreme = [k for k in comp["metrics"] if k.startswith("extreme")]
    assert extreme == [
        "extreme_fraction@3",
        "extreme_fraction@3_ci95",
        "extreme_fraction@2.50",
        "extreme_fraction@2.50_ci95",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pair", "rollout:nope"], "no such side (known sides: rollout, scores/bf16"),
        (["--pair", "rollout"], "expected REFERENCE:CANDIDATE"),
        (["--thresholds", "0.5"], "--thresholds: 0.5 must be a finite number >= 1"),
        (["--routing-scope", "prompt"], "--routing-scope: 'prompt', expected one of all, response"),
    ],
)
def test_report_bad_options_exit_2(moe_run, args, message):
    result = run_cli("report", moe_run, *args)
    assert result.exit_code == 2 and message in result.output


def test_dense_run_reports_probability_metrics_only(tmp_path):
    root = write_synthetic_run(tmp_path / "dense", SyntheticSpec(num_layers=0, top_k=0, num_experts=0, **SMALL))
    result = run_cli("report", root)
    assert result.exit_code == 0, result.output
    assert "dense model: no routing" in result.output
    (comp,) = json.loads((root / "report" / "metrics.json").read_text())["comparisons"]
    assert comp["metrics"]["k3_kl"] > 0
    assert all(comp["metrics"][key] is None for key in ROUTING_KEYS)
    # The synthetic run names no model folder, so the worst tokens' texts are null too.
    assert comp["notes"] == [
        "dense model: no routing",
        "worst_tokens: token texts are null: model folder synthetic not found",
    ]
    html = (root / "report" / "index.html").read_text()
    assert "dense model: no routing" in html and "Routing-difference histograms" not in html


def _rewrite(part, column, edit):
    table = pq.read_table(part)
    values = table.column(column).to_numpy(zero_copy_only=False).copy()
    edit(values)
    index = table.schema.get_field_index(column)
    table = table.set_column(index, table.schema.field(index), pa.array(values, type=table.schema.field(index).type))
    pq.write_table(table, part)
    return table


def _row(table, i):
    return table.column("sample_id")[i].as_py(), table.column("position")[i].as_py()


def test_misaligned_token_ids_exit_2_naming_sample_and_position(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(**SMALL))
    (part,) = (root / "scores" / "synthetic-bf16").glob("part-*.parquet")

    def bump(values):
        values[40] += 1

    table = _rewrite(part, "token_id", bump)
    sample, position = _row(table, 40)
    result = run_cli("report", root)
    assert result.exit_code == 2
    assert f"scores/synthetic-bf16 ({part.name}): token_id" in result.output
    assert f"at sample {sample} position {position} differs from rollout" in result.output
    assert "Traceback" not in result.output


def test_side_covering_fewer_samples_exit_2(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(**SMALL))
    (part,) = (root / "scores" / "synthetic-bf16").glob("part-*.parquet")
    table = pq.read_table(part)
    keep = table.filter(pa.compute.less(table.column("sample_id"), 10))
    pq.write_table(keep, part)
    result = run_cli("report", root)
    assert result.exit_code == 2
    assert "scores/synthetic-bf16: covers fewer samples than rollout: it ends after sample 9 position" in result.output
    assert "continues with sample 10 position 0" in result.output


def test_positive_logprob_exit_2(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(**SMALL))
    (part,) = (root / "rollout").glob("part-*.parquet")
    table = pq.read_table(part)
    i = int(np.flatnonzero(table.column("is_response").to_numpy(zero_copy_only=False))[0])

    def positive(values):
        values[i] = 0.5

    _rewrite(part, "logprob", positive)
    sample, position = _row(table, i)
    result = run_cli("report", root)
    assert result.exit_code == 2
    assert f"rollout ({part.name}) sample {sample} position {position}: logprob 0.5 > 0" in result.output


def test_expert_id_out_of_range_exit_2(tmp_path):
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(num_experts=16, **SMALL))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["num_experts"] = 8  # the stored ids go up to 15
    (root / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("report", root)
    assert result.exit_code == 2
    assert ">= num_experts 8 (from the run manifest)" in result.output and "sample 0 position" in result.output


def test_missing_run_and_empty_scores_exit_2(tmp_path):
    result = run_cli("report", tmp_path / "nowhere")
    assert result.exit_code == 2 and "run directory not found" in result.output
    root = write_synthetic_run(tmp_path / "run", SyntheticSpec(score_sets=(), **SMALL))
    result = run_cli("report", root)
    assert result.exit_code == 2 and "no score sets to compare the rollout with" in result.output


# The report in a child process whose address space is capped: an array indexed by sample id would need
# 32 GB and fail fast with MemoryError instead of swamping the machine. Prints the child's peak RSS in MB.
REPORT_IN_4_GB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from mismatch_probe.report.build import build_report
build_report(sys.argv[1], render=False)
# Its own peak (VmHWM, kB): Linux carries the parent's ru_maxrss over into a child, so pytest's peak would count.
print(int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]) // 1024)
"""


def _shift_sample_ids(side_dir, offsets: np.ndarray) -> None:
    for part in sorted(side_dir.glob("part-*.parquet")):
        table = pq.read_table(part)
        sid = table.column("sample_id").to_numpy()
        i = table.schema.get_field_index("sample_id")
        pq.write_table(table.set_column(i, table.schema.field(i), pa.array(sid + offsets[sid], pa.uint32())), part)


def test_sparse_sample_ids_near_4e9_report_in_the_usual_memory(tmp_path):
    """SPEC's sample ids are dense from 0, but readers must not size anything by the largest id."""
    spec = SyntheticSpec(
        **SMALL | dict(n_samples=8), score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.2, route_fraction=0.1),)
    )
    dense = write_synthetic_run(tmp_path / "dense", spec)
    sparse = write_synthetic_run(tmp_path / "sparse", spec)
    offsets = np.array([4_000_000_000 + 37_000_000 * i for i in range(8)], dtype=np.int64) - np.arange(8)
    for side in (sparse / "rollout", sparse / "scores" / "bf16"):
        _shift_sample_ids(side, offsets)
    peak = {}
    for name, root in (("dense", dense), ("sparse", sparse)):
        child = subprocess.run(
            [sys.executable, "-c", REPORT_IN_4_GB, str(root)], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == 0, child.stderr[-2000:]
        peak[name] = int(child.stdout.split()[-1])  # MB
    # The usual footprint: what the same report with dense ids takes (an id-sized table would need 32 GB).
    assert peak["sparse"] < peak["dense"] * 1.2 + 64, peak
    (got,), (want,) = (
        json.loads((root / "report" / "metrics.json").read_text())["comparisons"] for root in (sparse, dense)
    )
    # Bootstrap weights hash the sample id, so intervals differ; every value agrees.
    values = lambda m: {k: v for k, v in m.items() if not k.endswith("_ci95")}  # noqa: E731
    assert values(got["metrics"]) == pytest.approx(values(want["metrics"]), rel=1e-12)
    assert got["metrics"]["n_routing_sequences"] == 8 and got["routing_histograms"] == want["routing_histograms"]
    assert [e["sample_id"] for e in got["worst_tokens"]] == [
        int(offsets[e["sample_id"]] + e["sample_id"]) for e in want["worst_tokens"]
    ]
