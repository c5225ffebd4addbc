"""The dependency lanes' subset (`pytest -m lane`, docs/development.md) reaches every use of each declared
dependency: removing the mark from the test that carries a use fails here, naming the use."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# use -> a test id (or its prefix) that must be in the subset; each names what the floor versions must run
USES = {
    "pyarrow: the run layout written and read back, files of other pyarrow writers": "tests/test_run_format.py::",
    "pyarrow: the Parquet schema module": "tests/test_schema.py::",
    "polars: the doctor's token-id rule": "tests/test_doctor.py::test_token_ids_differ",
    "polars: the sweep's sibling runs": "tests/test_sweep.py::test_rollout_and_both_variants_make_a_sibling_run",
    "polars: the Recorder's logged runs": "tests/test_import.py::test_recorder_run_reads_back_and_reports",
    "transformers: hf generate and rescore through the CLI": "tests/test_cli_pipeline.py::",
    "transformers: the hf engines' contracts": "tests/test_hf_engines.py::",
    "transformers, safetensors: an FP8 checkpoint loaded and its end ids": "tests/test_quant_checkpoint.py::",
    "megatron-core, safetensors: megatron against transformers": (
        "tests/test_megatron.py::test_fp32_matches_transformers_with_unequal_lengths_and_padding"
    ),
    "megatron-core: the CPU shims": "tests/test_megatron_shims.py::",
    "megatron-core, torch.distributed: a two-process gloo group": "tests/test_megatron.py::test_two_process_gloo",
    "typer, click: every command's flags": "tests/test_help_flags.py::",
    "typer: every option reaches its job": "tests/test_cli_options_reach_jobs.py::",
    "rich: the gate's and worst tokens' tables": "tests/test_worst_tokens.py::",
    "matplotlib: the report's figures": "tests/test_report.py::test_report_writes_metrics_plots_and_html",
    "matplotlib: the compare page": "tests/test_compare_runs.py::",
    "matplotlib: the steps timeline": "tests/test_steps.py::",
    "matplotlib: the staleness figure": "tests/test_policy_page.py::test_stale_series_and_plot",
    "jinja2: the HTML report": "tests/test_html_report.py::",
    "numpy, torch: the importers' pickles": "tests/test_import.py::test_verl_dump_written_by_verl_imports_without_verl",
    "the importers' refusals": "tests/test_import_safety.py::",
    "tokenizers: token text": "tests/test_worst_tokens.py::test_cli_worst_prints_the_table_and_refuses_bad_counts",
    "requests: the served engines' clients": "tests/test_sglang_client.py::",
    "universal-pathlib, s3fs: a run at a URL": "tests/test_remote_runs.py::test_a_corrupt_part_on_s3",
    "the gate": "tests/test_gate.py::",
    "probe env: the versions it reports": "tests/test_env.py::",
    "the lowest lane's pins": "tests/test_lowest_pins.py::",
}


def test_the_lane_subset_reaches_every_use():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "lane", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    ids = [line for line in listed if "::" in line]
    missing = [use for use, prefix in USES.items() if not any(i.startswith(prefix) for i in ids)]
    assert not missing, f"no lane test for: {missing}"
    assert len(ids) < 400  # a subset, not the suite
