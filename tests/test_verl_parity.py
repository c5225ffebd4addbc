"""Every key carrying a verl name against verl 0.9.1's own rollout-correction functions on the same tokens.

verl runs in its own virtualenv (scripts/verl_env.sh --install; VERL_VENV to use another): the test skips when
it is absent. The run is built to hit what distinguishes verl's definitions: empty responses (verl averages
sequence keys over every row, an empty one counting as 0), a response with no finite log-prob (an empty row
to verl), tokens with abs(delta) > 20 both ways (verl clamps them), and sequences whose sum of delta passes 20.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.report.build import build_report
from mismatch_probe.report.keys.catalogue import CATALOGUE
from mismatch_probe.report.keys.levels import MODES
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VERL_VENV", ROOT / ".verl-venv"))
PYTHON = VENV / "bin" / "python"
CAPS, BOUNDS = ("1.5", "2", "5"), ("1.001", "1.05", "3")
CAND = "scores/cand"

needs_verl = pytest.mark.skipif(not PYTHON.exists(), reason=f"no verl virtualenv at {VENV} (scripts/verl_env.sh)")


def _plant(root: Path) -> None:
    """Log-probs with the cases verl treats apart, written over the synthetic run's (same rows on both sides)."""
    ref_part, cand_part = (sorted((root / side).glob("part-*.parquet")) for side in ("rollout", CAND))
    assert len(ref_part) == len(cand_part) == 1
    ref, cand = pq.read_table(ref_part[0]), pq.read_table(cand_part[0])
    sample, response = ref.column("sample_id").to_numpy(), ref.column("is_response").to_numpy()
    rng = np.random.default_rng(7)
    n = len(sample)
    lr = np.minimum(-rng.exponential(0.5, n), 0.0)
    lc = np.minimum(lr + rng.normal(0.0, 0.3, n), 0.0)
    tokens = np.flatnonzero(response)
    low, high = tokens[5], tokens[40]
    lc[low] = lr[low] - 25.0  # delta = -25
    lr[high], lc[high] = -30.0, -1.0  # delta = +29
    long = np.flatnonzero(response & (sample == sample[tokens[-1]]))
    lc[long] = np.minimum(lr[long] + 4.0, 0.0)  # a sequence whose sum of delta passes 20, if long enough
    lr[long] = np.minimum(lr[long], lc[long] - 3.0)
    dead = response & (sample == sample[tokens[len(tokens) // 2]])
    lc[dead] = np.nan  # a response with no finite log-prob: an empty row to verl
    for path, table, values in ((ref_part[0], ref, lr), (cand_part[0], cand, lc)):
        i = table.schema.get_field_index("logprob")
        column = pa.array(values.astype(np.float32), mask=~response)
        pq.write_table(table.set_column(i, table.schema.field(i), column), path, row_group_size=37)


def _padded(root: Path) -> dict[str, np.ndarray]:
    """[sequences, longest response] log-probs of each side and the compared-token mask, as verl takes them."""
    sides = {side: pq.read_table(next((root / side).glob("part-*.parquet"))) for side in ("rollout", CAND)}
    sample = sides["rollout"].column("sample_id").to_numpy()
    response = sides["rollout"].column("is_response").to_numpy()
    lp = {side: t.column("logprob").to_numpy(zero_copy_only=False).astype(np.float64) for side, t in sides.items()}
    lp = {side: np.where(response, values, 0.0) for side, values in lp.items()}
    ids, row = np.unique(sample, return_inverse=True)
    column = np.zeros(len(sample), dtype=np.int64)
    for i in range(len(ids)):  # a response's tokens in order, from column 0
        mine = np.flatnonzero(response & (row == i))
        column[mine] = np.arange(len(mine))
    width = max(int(column.max()) + 1, 1)
    out = {name: np.zeros((len(ids), width)) for name in ("ref", "cand")}
    mask = np.zeros((len(ids), width), dtype=bool)
    compared = response & np.isfinite(lp["rollout"]) & np.isfinite(lp[CAND])
    out["ref"][row[compared], column[compared]] = lp["rollout"][compared]
    out["cand"][row[compared], column[compared]] = lp[CAND][compared]
    mask[row[compared], column[compared]] = True
    # what the bit-mismatch count reads: every response token with a log-prob on both sides, NaN included
    valued = {side: t.column("logprob").is_valid().to_numpy(zero_copy_only=False) for side, t in sides.items()}
    both = response & valued["rollout"] & valued[CAND]
    raw = {name: np.zeros((len(ids), width)) for name in ("ref_raw", "cand_raw")}
    raw["ref_raw"][row[both], column[both]] = lp["rollout"][both]
    raw["cand_raw"][row[both], column[both]] = lp[CAND][both]
    valued_mask = np.zeros((len(ids), width), dtype=bool)
    valued_mask[row[both], column[both]] = True
    return out | raw | {"mask": mask, "valued": valued_mask}


def _family(key: str) -> str:
    """The catalogue name of a concrete key: `is_ess@2` -> `is_ess@C`, `rs_mean@seq_sum_k1` -> `rs_mean@MODE`."""
    name, at, level = key.partition("@")
    if not at:
        return key
    return name + ("@C" if level in CAPS else "@T" if level in BOUNDS else "@MODE")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    spec = SyntheticSpec(
        n_samples=60,
        num_layers=0,
        top_k=0,
        num_experts=0,
        prompt_len=(2, 6),
        response_len=(0, 24),
        seed=11,
        score_sets=(ScoreSetSpec("cand"),),
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("verl") / "run", spec)
    _plant(root)
    return root


def test_the_run_has_what_verl_treats_apart(run):
    arrays = _padded(run)
    delta = (arrays["cand"] - arrays["ref"])[arrays["mask"]]
    assert (delta < -20).any() and (delta > 20).any()
    per_sequence = arrays["mask"].sum(axis=1)
    assert (per_sequence == 0).sum() >= 2  # an empty response and the one with no finite log-prob
    sums = ((arrays["cand"] - arrays["ref"]) * arrays["mask"]).sum(axis=1)
    assert (sums > 20).any()


@needs_verl
def test_every_verl_named_key_is_verl_s_number(run, tmp_path):
    metrics = build_report(run, pairs=[("rollout", CAND)], tis_caps=CAPS, geo_bounds=BOUNDS, render=False).metrics[
        "comparisons"
    ][0]["metrics"]
    np.savez(tmp_path / "arrays.npz", **_padded(run))
    script = ROOT / "tests" / "verl_rollout_corr.py"
    # Run from an empty folder, -I: neither the checkout nor a stray package folder shadows verl's imports.
    subprocess.run(
        [
            str(PYTHON),
            "-I",
            str(script),
            str(tmp_path / "arrays.npz"),
            *map(",".join, (CAPS, BOUNDS, MODES)),
            "verl.json",
        ],
        cwd=tmp_path,
        check=True,
    )
    verl = json.loads((tmp_path / "verl.json").read_text())
    named = {entry.name for entry in CATALOGUE if "verl" in entry.peers}
    assert {_family(key) for key in verl} == named  # every verl-named key is compared
    assert len(verl) == len([key for key in metrics if key in verl])
    for key, value in sorted(verl.items()):
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
