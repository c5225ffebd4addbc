"""`probe report`, `probe gate`, `probe doctor`, `probe compare` and the engine registry start without importing
the engines' heavy dependencies."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "megatron", "sglang", "vllm")


def test_report_gate_and_doctor_do_not_import_torch():
    code = (
        "import sys, mismatch_probe.cli, mismatch_probe.report.build, mismatch_probe.gate.check, mismatch_probe.frames.align, "
        "mismatch_probe.doctor.run, mismatch_probe.doctor.show, mismatch_probe.gate.findings, mismatch_probe.engines, "
        "mismatch_probe.compare.runs; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
