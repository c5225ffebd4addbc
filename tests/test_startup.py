"""`probe report` and `probe gate` start without importing the engines' heavy dependencies."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "megatron", "sglang", "vllm")


def test_report_and_gate_do_not_import_torch():
    code = (
        "import sys, mismatch_probe.cli, mismatch_probe.report.build, mismatch_probe.gate.check, mismatch_probe.report.align; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
