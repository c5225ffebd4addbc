"""Runs written under one pyarrow are read under another (SPEC section 4, docs/run-directory.md).

tests/fixtures/runs/format<F>-pyarrow<P>/ was written by scripts/make_format_fixtures.py with run format F
under pyarrow P: format 2 under the lowest pyarrow in range (15) and the newest (26), and format 1 (today's
format before 2) under pyarrow 26. Each CI lane runs this file with its own pyarrow, so the lowest lane
reads what pyarrow 26 wrote, and the main lane reads what pyarrow 15 wrote. Every readable fixture must
give exactly the metrics of the same synthetic run written now by this lane's own pyarrow.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.schema import FIXED_LIST_PYARROW, SCHEMA_VERSION
from mismatch_probe.testing.synthetic import write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

ROOT = Path(__file__).parent / "fixtures" / "runs"
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_format_fixtures as fixtures  # noqa: E402

PYARROW_MAJOR = int(pa.__version__.split(".")[0])
FOLDERS = sorted(path.name for path in ROOT.iterdir())
SPECS = {"moe": fixtures.MOE, "dense": fixtures.DENSE}


def _report(run: Path) -> tuple[int, str, list[dict]]:
    result = CliRunner().invoke(app, ["report", str(run)], env={"COLUMNS": "200"})
    metrics = run / "report" / "metrics.json"
    comparisons = json.loads(metrics.read_text())["comparisons"] if result.exit_code == 0 else []
    return result.exit_code, result.output, [(c["reference"], c["candidate"], c["metrics"]) for c in comparisons]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict[str, list]:
    """The fixtures' runs written now, in the current format, with this lane's pyarrow."""
    out = {}
    for kind, spec in SPECS.items():
        run = write_synthetic_run(tmp_path_factory.mktemp("fresh") / kind, spec)
        code, output, comparisons = _report(run)
        assert code == 0, output
        out[kind] = comparisons
    return out


def test_fixtures_cover_both_ends_of_the_pyarrow_range():
    assert {f"format{SCHEMA_VERSION}-pyarrow15", f"format{SCHEMA_VERSION}-pyarrow26", "format1-pyarrow26"} <= set(
        FOLDERS
    )


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("folder", FOLDERS)
def test_a_run_from_another_pyarrow_reads_the_same(folder, kind, fresh, tmp_path):
    run = shutil.copytree(ROOT / folder / kind, tmp_path / kind)
    code, output, comparisons = _report(run)
    unreadable_here = folder.startswith("format1-") and PYARROW_MAJOR < FIXED_LIST_PYARROW
    if unreadable_here and (kind == "moe" or code != 0):
        # Format 1's null fixed-size list rows of width > 1 (pyarrow 25 still reads a dense run's width-1
        # column): one line naming the part and the pyarrow it needs.
        assert code == 2, output
        part = run / "rollout" / "part-0000000000.parquet"
        assert f"error: {part}: row group 0: written in run format 1" in output
        assert f"which pyarrow {pa.__version__} cannot read; it needs pyarrow >= 26" in output
        assert "Traceback" not in output
        return
    assert code == 0, output
    assert comparisons == fresh[kind]
    assert comparisons and all(metrics["k3_kl"] > 0 for _, _, metrics in comparisons)
