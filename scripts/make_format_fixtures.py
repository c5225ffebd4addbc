"""Write the small run that tests/test_run_format.py reads across pyarrow versions.

`python scripts/make_format_fixtures.py` writes tests/fixtures/runs/format<SCHEMA_VERSION>-pyarrow<MAJOR>/ with
the installed probe and pyarrow: a synthetic MoE run (rows with no routing on both sides, the optional
expert_logprobs-free columns, router margins) plus a dense one. Run it under the lowest pyarrow in range and
under the newest, and commit both folders: each lane then reads the run another pyarrow wrote.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pyarrow as pa

from mismatch_probe.schema import SCHEMA_VERSION
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "runs"
MOE = SyntheticSpec(
    num_layers=3,
    top_k=2,
    num_experts=8,
    n_samples=12,
    prompt_len=(3, 6),
    response_len=(4, 12),
    seed=7,
    router_margin=True,
    score_sets=(
        ScoreSetSpec(name="routed", route_fraction=0.2, logprob_sigma=0.05),
        ScoreSetSpec(name="unrouted", routing=False, logprob_sigma=0.02),
    ),
)
DENSE = SyntheticSpec(num_layers=0, top_k=0, num_experts=0, n_samples=6, response_len=(4, 8), seed=3)


def main() -> None:
    folder = ROOT / f"format{SCHEMA_VERSION}-pyarrow{pa.__version__.split('.')[0]}"
    shutil.rmtree(folder, ignore_errors=True)
    write_synthetic_run(folder / "moe", MOE)
    write_synthetic_run(folder / "dense", DENSE)
    print(folder, file=sys.stderr)


if __name__ == "__main__":
    main()
