"""A run at a URL: `probe report s3://BUCKET/RUN` (and gate, doctor) against a real S3 protocol server (moto's,
on localhost), read through universal-pathlib and s3fs. The report is the same as that of the same run on
disk, in one process, in worker processes and as Ray tasks that read their own row groups from S3; the
report's files are written into the run's prefix, and nothing lands on the local disk."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from frames import assert_close

from mismatch_probe.errors import ProbeError
from mismatch_probe.report.build import build_report
from mismatch_probe.report.stream import plan
from mismatch_probe.report.stream.ray_tasks import LOCAL, ray_session
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.location import run_path
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "probe-runs"
SPEC = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=12,
    n_samples=40,
    prompt_len=(2, 6),
    response_len=(3, 30),
    seed=23,
    router_margin=True,
    samples_per_part=15,
    score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.3, route_fraction=0.2),),
)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A local S3 server, the environment pointing at it (as a user's credentials and endpoint would), and a
    bucket holding a run whose parts have several row groups, beside the same run on disk."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        local = write_synthetic_run(tmp_path_factory.mktemp("remote") / "run", SPEC)
        for part in local.rglob("part-*.parquet"):
            pq.write_table(pq.read_table(part), part, row_group_size=37)  # several units, cut mid-sequence
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        fs.put(str(local), f"{BUCKET}/run", recursive=True)
        yield fs, local
    server.stop()


@pytest.fixture(scope="module")
def on_disk(s3):
    """The report of the run on disk, its run path (in the hints it prints) written as the URL."""
    local = s3[1]
    metrics = build_report(local, render=False, workers=1).metrics
    return json.loads(json.dumps(metrics).replace(str(local), f"s3://{BUCKET}/run"))


def _remote_metrics(fs) -> dict:
    fs.invalidate_cache()
    return json.loads(fs.cat(f"{BUCKET}/run/report/metrics.json"))


def _same(got: dict, want: dict) -> None:
    assert_close(got["comparisons"], want["comparisons"])
    assert_close(got["attribution"], want["attribution"])
    assert got["findings"] == want["findings"]


def _probe(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch_probe.cli", *args], capture_output=True, text=True)


@pytest.mark.slow  # four CLI commands end to end on an object store
def test_cli_report_gate_and_doctor_on_an_s3_run(s3, on_disk, tmp_path, monkeypatch):
    fs, _ = s3
    monkeypatch.chdir(tmp_path)  # nothing may be written here
    done = _probe("report", f"s3://{BUCKET}/run")
    assert done.returncode == 0, done.stderr
    assert f"metrics: s3://{BUCKET}/run/report/metrics.json" in done.stdout
    fs.invalidate_cache()
    assert sorted(fs.ls(f"{BUCKET}/run/report")) == [f"{BUCKET}/run/report/{n}" for n in ("index.html", "metrics.json")]
    assert fs.cat(f"{BUCKET}/run/report/index.html").startswith(b"<!DOCTYPE html>")
    _same(_remote_metrics(fs), on_disk)
    assert list(tmp_path.iterdir()) == []
    rerun = _probe("report", f"s3://{BUCKET}/run")  # the report's own files are replaced, as on disk
    assert rerun.returncode == 0, rerun.stderr
    gate = _probe("gate", f"s3://{BUCKET}/run", "--max", "k3_kl=10")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "0 of" in gate.stdout and "checks failed" in gate.stdout
    doctor = _probe("doctor", f"s3://{BUCKET}/run", "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert json.loads(doctor.stdout) == {"healthy": True, "findings": []}


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_gate_baseline_at_a_url(s3, on_disk, tmp_path):
    """--baseline takes a URL as RUN does: the run on disk gated against its own copy in S3 (the same metrics,
    so nothing regresses), and a baseline URL with no run there exits 2 naming it."""
    fs, local = s3
    same = _probe("gate", str(local), "--baseline", f"s3://{BUCKET}/run", "--pair", "rollout:bf16")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "baseline 0.0283" in same.stdout.replace("│", " ") and "0 of 16 checks failed" in same.stdout
    missing = _probe("gate", str(local), "--baseline", f"s3://{BUCKET}/no-such-run")
    assert missing.returncode == 2
    assert missing.stderr == f"error: s3://{BUCKET}/no-such-run: run directory not found\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["notes.txt", "my_plot.png"])
def test_an_s3_report_folder_holding_a_users_file_is_refused_and_kept(s3, name):
    fs, local = s3  # a run of its own per file: the refusal must leave each report folder as it was
    prefix = f"{BUCKET}/users-{name}"
    fs.put(str(local), prefix, recursive=True)
    fs.pipe(f"{prefix}/report/{name}", b"mine")
    before = {path: fs.cat(path) for path in fs.find(f"{prefix}/report")}
    assert before[f"{prefix}/report/{name}"] == b"mine"
    done = _probe("report", f"s3://{prefix}")
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: s3://{prefix}/report: not a probe report folder (holds {name}); refusing to replace it\n"
    )
    fs.invalidate_cache()
    assert {path: fs.cat(path) for path in fs.find(f"{prefix}/report")} == before


@pytest.mark.slow  # starts Ray or worker processes on an object store
def test_worker_processes_read_their_own_ranges_from_s3(s3, on_disk, monkeypatch):
    monkeypatch.setattr(plan, "MIN_UNIT_ROWS", 100)
    root = run_path(f"s3://{BUCKET}/run")
    assert len(plan.plan_units(Run(root), ["rollout", "scores/bf16"], Run(root).manifest().routing, 2)) > 1
    _same(build_report(root, render=False, workers=2).metrics, on_disk)
    _same(_remote_metrics(s3[0]), on_disk)


@pytest.mark.slow  # starts Ray or worker processes on an object store
def test_ray_tasks_read_their_own_ranges_from_s3(s3, on_disk, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setattr(plan, "MIN_UNIT_ROWS", 100)
    with ray_session(LOCAL, 2):  # the workers see the environment's endpoint and credentials
        _same(build_report(f"s3://{BUCKET}/run", render=False, ray=LOCAL).metrics, on_disk)


@pytest.mark.lane  # docs/development.md: the dependency lanes' subset
def test_a_corrupt_part_on_s3_is_one_line_naming_its_url(s3, tmp_path):
    fs, local = s3
    fs.put(str(local), f"{BUCKET}/broken", recursive=True)
    part = sorted(fs.glob(f"{BUCKET}/broken/scores/bf16/part-*.parquet"))[0]
    fs.pipe(part, fs.cat(part)[:-100])  # the footer is gone
    with pytest.raises(ProbeError) as raised:
        build_report(f"s3://{BUCKET}/broken", render=False, workers=1)
    assert str(raised.value).startswith(f"s3://{part}: not a readable Parquet file (")
    assert "\n" not in str(raised.value)


def test_urls_that_cannot_be_opened_exit_2_with_one_line(s3):
    missing = _probe("report", f"s3://{BUCKET}/nothere")
    assert (missing.returncode, missing.stderr) == (2, f"error: s3://{BUCKET}/nothere: run directory not found\n")
    unknown = _probe("report", "nosuch://x/run")
    assert unknown.returncode == 2
    assert unknown.stderr == "error: nosuch://x/run: cannot open this URL (Unsupported filesystem: 'nosuch')\n"
    code = "import sys; sys.modules['upath'] = None\nfrom mismatch_probe.cli import app\napp(['report', 's3://b/r'])\n"
    without = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert without.returncode == 2
    assert without.stderr == (
        "error: s3://b/r: a run at a URL needs universal-pathlib, which is not installed: "
        "pip install 'mismatch-probe[remote]'\n"
    )
