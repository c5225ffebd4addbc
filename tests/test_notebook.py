"""notebooks/explore_run.ipynb runs top to bottom on a small run and agrees with report/metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch_probe.report.build import build_report
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.slow  # the notebook runs in a kernel

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore_run.ipynb"
SPEC = SyntheticSpec(
    num_layers=6,
    top_k=2,
    num_experts=16,
    n_samples=24,
    prompt_len=(3, 9),
    response_len=(10, 40),
    score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.3, route_fraction=0.05, shuffle_order=True),),
)


def execute(run: Path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("PROBE_RUN", str(run))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    return notebook


def outputs(notebook) -> str:
    return "\n".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


def test_notebook_outputs_are_cleared_in_git():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    root = write_synthetic_run(tmp_path_factory.mktemp("nb") / "run", SPEC)
    build_report(root, render=False)
    return root


def test_notebook_recomputes_the_report(small_run, monkeypatch):
    notebook = execute(small_run, monkeypatch)
    text = outputs(notebook)
    reported = json.loads((small_run / "report" / "metrics.json").read_text())["comparisons"][0]["metrics"]
    assert reported["k3_kl"] > 0 and reported["router_diff_rate"] > 0  # the asserts inside compare real values
    assert f"(report: {reported['k3_kl']:.6g})" in text
    assert f"(report: {reported['router_diff_rate']:.6g})" in text
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the layer x position heatmap and the mismatch-by-position curve


def test_notebook_fails_when_the_report_disagrees(small_run, tmp_path, monkeypatch):
    """The notebook's checks bite: a metrics.json with a wrong k3_kl stops it with an error."""
    import shutil

    run = shutil.copytree(small_run, tmp_path / "run")
    path = run / "report" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["comparisons"][0]["metrics"]["k3_kl"] *= 1.01
    path.write_text(json.dumps(metrics))
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="AssertionError"):
        execute(run, monkeypatch)
