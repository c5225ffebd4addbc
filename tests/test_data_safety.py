"""probe replaces only what it recognisably wrote: a folder holding anything of the user's is refused
with exit 2, naming the folder and one foreign entry, and nothing in it is touched. Every writer goes
through the CLI on real folders: generate/rescore --overwrite, the report folder, compare --out, demo --out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import write_text_atomic
from mismatch_probe.rundir.layout import REPORT_LAYOUT, RUN_LAYOUT
from mismatch_probe.rundir.ownership import foreign_entry
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

runner = CliRunner()
NOTES = b"my notes: do not lose\n"
SMALL = SyntheticSpec(
    n_samples=6,
    prompt_len=(2, 4),
    response_len=(3, 6),
    router_margin=True,
    score_sets=(ScoreSetSpec("a", repeat_group="a", pass_index=1), ScoreSetSpec("b", repeat_group="a", pass_index=2)),
)


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root` with a file's bytes (None for a folder): what 'nothing touched' compares."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [f"error: {message}"], (
        result.output
    )


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [3 + i, 4, 5]}) + "\n" for i in range(3)))
    return path


def generate(model, prompts, out, *extra):
    return probe("generate", "--model", model, "--prompts", prompts, "--out", out, "--max-new-tokens", 3, *extra)


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, tiny_dense, prompts) -> Path:
    """A real run of the tiny dense model with one score set, hf-fp32."""
    run = tmp_path_factory.mktemp("scored") / "run"
    assert generate(tiny_dense, prompts, run).exit_code == 0
    assert probe("rescore", run).exit_code == 0
    return run


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> Path:
    """A synthetic MoE run with every kind of report figure (repeated passes, router margins)."""
    run = write_synthetic_run(tmp_path_factory.mktemp("reported") / "run", SMALL)
    assert probe("report", run).exit_code == 0
    return run


@pytest.fixture
def run(reported, tmp_path) -> Path:
    return Path(shutil.copytree(reported, tmp_path / "run"))


# ---- generate --overwrite --------------------------------------------------------------------


def test_generate_overwrite_refuses_a_users_folder(tiny_dense, prompts, tmp_path):
    home = tmp_path / "work"
    (home / "thesis").mkdir(parents=True)
    (home / "notes.txt").write_bytes(NOTES)
    (home / "thesis" / "draft.tex").write_text("\\section{x}")
    before = tree(home)
    refused(
        generate(tiny_dense, prompts, home, "--overwrite"),
        f"{home}: not a probe run (holds notes.txt); refusing to replace it",
    )
    assert tree(home) == before
    assert (home / "notes.txt").read_bytes() == NOTES


def test_generate_overwrite_refuses_a_run_holding_a_users_file(tiny_dense, prompts, run):
    for where, named in (
        (run, "notes.txt"),
        (run / "report", "report/notes.txt"),
        (run / "scores" / "a", "scores/a/notes.txt"),
        (run / "rollout", "rollout/notes.txt"),
    ):
        (where / "notes.txt").write_bytes(NOTES)
        before = tree(run)
        refused(
            generate(tiny_dense, prompts, run, "--overwrite"),
            f"{run}: not a probe run (holds {named}); refusing to replace it",
        )
        assert tree(run) == before
        (where / "notes.txt").unlink()


def test_generate_overwrite_refuses_a_manifest_probe_did_not_write(tiny_dense, prompts, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "manifest.json").write_text('{"name": "my web app", "version": 3}\n')
    (project / "report").mkdir()
    (project / "report" / "index.html").write_text("<h1>my page</h1>")
    before = tree(project)
    refused(
        generate(tiny_dense, prompts, project, "--overwrite"),
        f"{project}: not a probe run (holds manifest.json, which probe did not write); refusing to replace it",
    )
    assert tree(project) == before
    (project / "manifest.json").unlink()  # no manifest at all: its report/ alone does not make it a run
    refused(
        generate(tiny_dense, prompts, project, "--overwrite"),
        f"{project}: not a probe run (holds report but no manifest.json); refusing to replace it",
    )
    assert (project / "report" / "index.html").read_text() == "<h1>my page</h1>"


def test_generate_overwrite_never_follows_a_symlink_out_of_the_run(tiny_dense, prompts, run, tmp_path):
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    (elsewhere / "part-0000000000.parquet").write_bytes(NOTES)  # named like a part, but the user's
    shutil.rmtree(run / "rollout")
    (run / "rollout").symlink_to(elsewhere, target_is_directory=True)
    refused(
        generate(tiny_dense, prompts, run, "--overwrite"),
        f"{run}: not a probe run (holds rollout, a symbolic link); refusing to replace it",
    )
    assert (elsewhere / "part-0000000000.parquet").read_bytes() == NOTES


def test_generate_overwrite_refuses_a_file(tiny_dense, prompts, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(NOTES)
    refused(generate(tiny_dense, prompts, path, "--overwrite"), f"{path}: exists and is not a directory")
    assert path.read_bytes() == NOTES


def test_generate_overwrite_replaces_a_probe_run(tiny_dense, prompts, run):
    """A finished run with score sets and a report is replaced by the new rollout alone."""
    result = generate(tiny_dense, prompts, run, "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "rollout"]
    assert json.loads((run / "manifest.json").read_text())["model"] == str(tiny_dense)


def test_generate_overwrite_through_a_symlinked_run_folder(tiny_dense, prompts, run, tmp_path):
    link = tmp_path / "latest"
    link.symlink_to(run, target_is_directory=True)
    assert generate(tiny_dense, prompts, link, "--overwrite").exit_code == 0
    assert link.is_symlink() and sorted(p.name for p in run.iterdir()) == ["manifest.json", "rollout"]


def test_generate_into_an_empty_folder(tiny_dense, prompts, tmp_path):
    (tmp_path / "empty").mkdir()
    assert generate(tiny_dense, prompts, tmp_path / "empty").exit_code == 0
    assert (tmp_path / "empty" / "manifest.json").is_file()


# ---- rescore --overwrite ---------------------------------------------------------------------


def test_rescore_overwrite_refuses_a_score_set_holding_a_users_file(scored_run, tmp_path):
    run = Path(shutil.copytree(scored_run, tmp_path / "run"))
    folder = run / "scores" / "hf-fp32"
    (folder / "notes.txt").write_bytes(NOTES)
    before = tree(run)
    refused(
        probe("rescore", run, "--overwrite"),
        f"{folder}: not a probe score set (holds notes.txt); refusing to replace it",
    )
    assert tree(run) == before


def test_rescore_checks_every_pass_before_replacing_any(scored_run, tmp_path):
    run = Path(shutil.copytree(scored_run, tmp_path / "run"))
    assert probe("rescore", run, "--repeats", 2).exit_code == 0
    user = run / "scores" / "hf-fp32-pass2" / "analysis.csv"
    user.write_bytes(NOTES)
    before = tree(run)
    refused(
        probe("rescore", run, "--repeats", 2, "--overwrite"),
        f"{user.parent}: not a probe score set (holds analysis.csv); refusing to replace it",
    )
    assert tree(run) == before  # pass 1 is a probe score set, but is not replaced either


def test_rescore_overwrite_replaces_a_score_set(scored_run, tmp_path):
    run = Path(shutil.copytree(scored_run, tmp_path / "run"))
    manifest = run / "scores" / "hf-fp32" / "manifest.json"
    (manifest.parent / ".part-0000000000.parquet.tmp").write_bytes(b"left by a crash")
    result = probe("rescore", run, "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads(manifest.read_text())["status"] == "complete"
    assert sorted(p.name for p in manifest.parent.iterdir()) == ["manifest.json", "part-0000000000.parquet"]


def test_rescore_name_stays_inside_the_run(scored_run, tmp_path):
    run = Path(shutil.copytree(scored_run, tmp_path / "run"))
    before = tree(tmp_path)
    refused(
        probe("rescore", run, "--name", "../..", "--overwrite"),
        "--name '../..': expected a plain folder name (no '/' or '..')",
    )
    assert tree(tmp_path) == before


# ---- the report folder -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["notes.txt", "my_plot.png"])
def test_report_refuses_a_folder_holding_a_users_file(run, name):
    user = run / "report" / name
    user.write_bytes(NOTES)
    before = tree(run / "report")
    refused(probe("report", run), f"{run / 'report'}: not a probe report folder (holds {name}); refusing to replace it")
    assert tree(run / "report") == before


def test_report_refuses_a_metrics_json_probe_did_not_write(run):
    metrics = run / "report" / "metrics.json"
    metrics.write_text('{"accuracy": 0.93}\n')
    refused(
        probe("report", run),
        f"{run / 'report'}: not a probe report folder "
        "(holds metrics.json, which probe did not write); refusing to replace it",
    )
    assert metrics.read_text() == '{"accuracy": 0.93}\n'


def test_report_recognises_every_file_it_writes_and_replaces_them(run):
    assert foreign_entry(run / "report", REPORT_LAYOUT) is None and foreign_entry(run, RUN_LAYOUT) is None
    assert sorted(p.name for p in (run / "report").iterdir()) == ["index.html", "metrics.json"]  # figures inline
    # the sibling figures an earlier version of the report wrote are its own: recognised, then removed
    old = ["extreme_fraction.png", "routing_token.png", "forensics_rollout__scores_b.png"]
    for name in old:
        (run / "report" / name).write_bytes(b"\x89PNG\r\n\x1a\n")
    assert foreign_entry(run / "report", REPORT_LAYOUT) is None
    result = probe("report", run, "--pair", "rollout:scores/a")
    assert result.exit_code == 0, result.output
    assert not list((run / "report").glob("*.png"))


# ---- compare --out ---------------------------------------------------------------------------


def test_compare_out_refuses_a_users_folder(run, tmp_path):
    other = Path(shutil.copytree(run, tmp_path / "other"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_bytes(NOTES)
    refused(
        probe("compare", run, other, "--out", site),
        f"{site}: not a probe compare folder (holds index.html but no compare.json); refusing to replace it",
    )
    assert (site / "index.html").read_bytes() == NOTES
    assert probe("compare", run, other, "--out", tmp_path / "cmp").exit_code == 0
    (tmp_path / "cmp" / "notes.txt").write_bytes(NOTES)
    refused(
        probe("compare", run, other, "--out", tmp_path / "cmp"),
        f"{tmp_path / 'cmp'}: not a probe compare folder (holds notes.txt); refusing to replace it",
    )
    assert (tmp_path / "cmp" / "notes.txt").read_bytes() == NOTES
    (tmp_path / "cmp" / "notes.txt").unlink()
    assert probe("compare", run, other, "--out", tmp_path / "cmp").exit_code == 0  # its own output: replaced


# ---- demo --out ------------------------------------------------------------------------------


def test_demo_refuses_before_any_work(reported, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(reported, out / "dense")  # a previous demo's run: fine to replace
    (out / "moe").mkdir()
    (out / "moe" / "notes.txt").write_bytes(NOTES)
    before = tree(out)
    refused(
        probe("demo", "--out", out, "--num-prompts", 1),
        f"{out}: not a probe demo folder (holds moe/notes.txt); refusing to replace it",
    )
    assert tree(out) == before
    shutil.rmtree(out / "moe")
    (out / "summary.json").write_text('{"total": 12}\n')
    refused(
        probe("demo", "--out", out, "--num-prompts", 1),
        f"{out}: not a probe demo folder (holds summary.json, which probe did not write); refusing to replace it",
    )
    assert (out / "summary.json").read_text() == '{"total": 12}\n'


def test_an_atomic_write_is_utf8_and_a_failed_one_leaves_no_temporary_file(tmp_path):
    """Every file probe writes whole (metrics.json, index.html, JUnit XML) goes through write_text_atomic."""
    page = tmp_path / "page.html"
    write_text_atomic(page, "δ ≤ 1e-3 — ok")
    assert page.read_bytes() == "δ ≤ 1e-3 — ok".encode()
    taken = tmp_path / "gate.xml"  # a folder of the user's where the file would go: the rename fails
    taken.mkdir()
    (taken / "mine.txt").write_text("mine")
    with pytest.raises(ProbeError) as raised:
        write_text_atomic(taken, "<testsuites/>", what="JUnit XML")
    assert str(raised.value).startswith(f"{taken}: cannot write JUnit XML (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.xml", "page.html"]
    assert (taken / "mine.txt").read_text() == "mine"
