"""`probe doctor RUN`: the checks in a streaming pass of their own (the report runs them in its pass)."""

from __future__ import annotations

from mismatch_probe.doctor.checks.check_list import TEMPERATURE_MISMATCH
from mismatch_probe.doctor.finding import Finding
from mismatch_probe.doctor.rules.recorded import recorded_temperatures
from mismatch_probe.doctor.rules.token_ids import token_id_findings
from mismatch_probe.doctor.state import Doctor
from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.align import aligned_chunks
from mismatch_probe.frames.expert_sets import expert_bit_table
from mismatch_probe.frames.pair_frame import FrameBuilder
from mismatch_probe.report.keys.request import resolve
from mismatch_probe.rundir.layout import SCORES, Run


def run_checks(run_path, pairs=None) -> list[Finding]:
    """Findings of the run's comparisons (by default those its report compares); exit-2 errors for a run
    that cannot be read at all."""
    run = Run(run_path)
    manifest = run.manifest()
    request, _ = resolve(run, pairs)
    pairs = request.pair_list(run)
    if not pairs:
        raise ProbeError(f"{run.root / SCORES}: no score sets to check the rollout against (run `probe rescore` first)")
    doctor = Doctor(run, pairs)
    shape = manifest.routing
    builder = FrameBuilder(shape=shape)
    keys = [(ref, cand, None) for ref, cand in pairs]
    recorded = recorded_temperatures(run, manifest, doctor.sides)
    flagged = {finding.evidence["side"] for finding in recorded}
    run.check_sides(manifest, [side for side in doctor.sides if side not in flagged])
    try:
        # ids >= num_experts are the engine's bug to name (routes_invalid), not input to refuse: the doctor
        # counts them and compares them as one extra "expert", so its routing comparison can go on
        for chunks in aligned_chunks(run, doctor.sides, shape, expert_ids=False):
            if doctor.out_of_range(chunks) and len(builder.bit_table) <= shape.num_experts:
                builder.bit_table = expert_bit_table(shape.num_experts + 1)
            doctor.update(builder.frames(chunks, keys))
    except ProbeError:
        # Sides that do not line up: the usual cause is another tokenisation; name the ids if so.
        findings = token_id_findings(run, doctor.sides)
        if not findings:
            raise
        return recorded + findings
    # The data's own temperature finding on a side its manifest already flags would say it again.
    again = lambda f: f.check == TEMPERATURE_MISMATCH.name and f.evidence.get("side") in flagged  # noqa: E731
    return recorded + [f for f in doctor.findings() if not again(f)]
