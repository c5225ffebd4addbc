"""`probe compare RUN_A RUN_B ...` on small reported synthetic runs: files, numbers, labels, bad input."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.compare.runs import run_labels
from mismatch_probe.report.build import build_report
from mismatch_probe.report.numbers import with_interval
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
SMALL = dict(n_samples=8, prompt_len=(2, 4), response_len=(3, 8))


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def _reported(root: Path, *sides: ScoreSetSpec, seed: int = 0) -> Path:
    write_synthetic_run(root, SyntheticSpec(**SMALL, seed=seed, score_sets=sides))
    build_report(root, render=False)
    return root


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cmp")
    # Both runs are called "run": their labels take the parent folder. The second has an R3 side the first lacks.
    a = _reported(base / "step-100" / "run", ScoreSetSpec("bf16", logprob_sigma=0.02))
    b = _reported(
        base / "step-<200>" / "run",
        ScoreSetSpec("bf16", logprob_sigma=0.08),
        ScoreSetSpec("r3", replay="r3", route_fraction=0.0),
        seed=1,
    )
    return a, b


def _metrics(root: Path) -> dict:
    data = json.loads((root / "report" / "metrics.json").read_text())
    return {(c["reference"], c["candidate"]): c["metrics"] for c in data["comparisons"]}


def test_compare_writes_table_json_and_page(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "cmp"
    result = probe("compare", a, b, "--out", out, "--keys", "k3_kl,router_diff_rate")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "compare.json").read_text())
    assert data["keys"] == ["k3_kl", "router_diff_rate"]
    assert [r["label"] for r in data["runs"]] == ["step-100/run", "step-<200>/run"]
    pairs = [(c["reference"], c["candidate"]) for c in data["comparisons"]]
    assert pairs == [("rollout", "scores/bf16"), ("rollout", "scores/r3")]
    ma, mb = _metrics(a), _metrics(b)
    bf16 = data["comparisons"][0]["runs"]
    for label, metrics in (("step-100/run", ma), ("step-<200>/run", mb)):
        for key in ("k3_kl", "k3_kl_ci95", "router_diff_rate", "router_diff_rate_ci95"):
            assert bf16[label][key] == metrics["rollout", "scores/bf16"][key]
    assert bf16["step-<200>/run"]["k3_kl"] > bf16["step-100/run"]["k3_kl"]  # planted: noise 0.08 against 0.02
    assert data["comparisons"][1]["runs"]["step-100/run"] is None  # only the second run has the R3 side
    # Terminal table: each (comparison, run) row with its interval; the missing comparison shows —.
    k3 = mb["rollout", "scores/bf16"]
    assert with_interval(k3["k3_kl"], k3["k3_kl_ci95"]) in result.output
    r3_rows = [line for line in result.output.splitlines() if "step-100/run" in line and "—" in line]
    assert len(r3_rows) == 1


def test_compare_page_is_self_contained_and_escaped(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "page"
    assert probe("compare", a, b, "--out", out).exit_code == 0
    html = (out / "index.html").read_text()
    assert "step-&lt;200&gt;/run" in html and "step-<200>" not in html
    assert not re.search(r'src="(?!data:)', html)  # nothing to fetch: the figure is embedded
    png = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', html).group(1))
    assert png.startswith(b"\x89PNG")
    (out / "embedded.png").write_bytes(png)
    with Image.open(out / "embedded.png") as image:
        assert image.width > 400 and image.height > 200
    mb = _metrics(b)["rollout", "scores/r3"]
    value, interval = with_interval(mb["k3_kl"], mb["k3_kl_ci95"]).split(" [")
    assert f'<td class="num">{value}<br><span class="ci">[{interval}</span></td>' in html
    assert html.count("<tr>") == 1 + 2 * 2  # header, then 2 comparisons x 2 runs


def test_run_labels_are_told_apart():
    assert run_labels([Path("/x/a/run"), Path("/x/b/run"), Path("/x/c")]) == ["a/run", "b/run", "c"]
    assert run_labels([Path("/x/a"), Path("/x/a")]) == ["a #1", "a #2"]


def _refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], result.output


def test_compare_bad_inputs(two_runs, tmp_path):
    a, b = two_runs
    _refused(probe("compare", a, "--out", tmp_path / "o"), "probe compare: expected at least 2 runs, got 1")
    _refused(probe("compare", "--out", tmp_path / "o"), "probe compare: expected at least 2 runs, got 0")
    _refused(probe("compare", a, tmp_path / "nope"), f"{tmp_path / 'nope'}: run directory not found")
    bare = tmp_path / "bare"
    write_synthetic_run(bare, SyntheticSpec(**SMALL))
    _refused(probe("compare", a, bare), f"{bare}/report/metrics.json: file not found (run `probe report {bare}` first)")
    result = probe("compare", a, b, "--keys", "k3_kl,k9_kl", "--out", tmp_path / "o")
    _refused(result, result.output.strip().splitlines()[-1].removeprefix("error: "))
    assert (
        result.output.strip()
        .splitlines()[-1]
        .startswith("error: --keys: unknown key 'k9_kl' (in no run's metrics.json; known keys: ")
    )
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_compare_a_folder_that_is_no_run(two_runs, tmp_path):
    """A folder without manifest.json needs another path, not `probe report`."""
    a, _ = two_runs
    notarun = tmp_path / "notarun"
    notarun.mkdir()
    (notarun / "notes.txt").write_text("not a run")
    _refused(probe("compare", a, notarun, "--out", tmp_path / "o"), f"{notarun}: not a probe run (no manifest.json)")
    assert not (tmp_path / "o").exists()


def test_compare_marks_intervals_that_do_not_overlap(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "marks"
    result = probe("compare", a, b, "--out", out, "--keys", "k3_kl")
    assert result.exit_code == 0, result.output
    ka, kb = _metrics(a)["rollout", "scores/bf16"], _metrics(b)["rollout", "scores/bf16"]
    assert kb["k3_kl_ci95"][0] > ka["k3_kl_ci95"][1]  # planted: noise 0.08 against 0.02
    row = next(line for line in result.output.splitlines() if "step-<200>/run" in line and "▲" in line)
    assert "▲ above step-100/run" in row and with_interval(kb["k3_kl"], kb["k3_kl_ci95"]) in row
    html = (out / "index.html").read_text()
    assert html.count('class="separates above">▲ above step-100/run') == 1  # the first run is never marked


def test_compare_axes_label_each_tick_once(tmp_path):
    """F(t) of two runs within one decade (0.0026..0.0036): log axes labelled each minor tick "3e-03"."""
    import matplotlib.pyplot as plt

    from mismatch_probe.compare.page import _draw_panel
    from mismatch_probe.compare.runs import CompareResult, RunMetrics

    t = [1, 1.5, 2, 3, 5, 10]
    curves = ([0.0031, 0.0030, 0.0029, 0.0028, 0.0027, 0.0026], [0.0036, 0.0035, 0.0034, 0.0033, 0.0032, 0.0031])
    runs = [
        RunMetrics(
            label=label,
            root=tmp_path / label,
            metrics={
                "comparisons": [
                    {
                        "reference": "rollout",
                        "candidate": "scores/bf16",
                        "metrics": {},
                        "extreme_fraction_curve": {"t": t, "fraction": fraction},
                    }
                ]
            },
        )
        for label, fraction in zip(("a", "b"), curves)
    ]
    result = CompareResult(runs=runs, keys=["k3_kl"], pairs=[("rollout", "scores/bf16")], out=tmp_path)
    fig, ax = plt.subplots()
    _draw_panel(ax, result, "rollout vs scores/bf16", ("rollout", "scores/bf16"), [0, 1], 20.0)
    fig.canvas.draw()
    for axis, coordinate in ((ax.xaxis, 0), (ax.yaxis, 1)):
        lo, hi = sorted(axis.get_view_interval())
        shown = [
            label.get_text()
            for label in axis.get_ticklabels(which="both")
            if label.get_text() and lo <= label.get_position()[coordinate] <= hi
        ]
        assert shown and len(shown) == len(set(shown)), shown
    plt.close(fig)
