"""temperature_mismatch as the manifests record it: a score set scored at another temperature than the
rollout's scoring temperature. `probe report` refuses such a run (exit 2); the doctor names it as a
finding and checks the rest of the run."""

from __future__ import annotations

from mismatch_probe.doctor.checks import check_list as C
from mismatch_probe.doctor.finding import Finding
from mismatch_probe.rundir.layout import ROLLOUT, Run
from mismatch_probe.rundir.manifests import RolloutManifest


def recorded_temperatures(run: Run, manifest: RolloutManifest, sides: list[str]) -> list[Finding]:
    findings = []
    for side in sides:
        if side == ROLLOUT:
            continue
        scored = run.score_manifest(side.split("/", 1)[1]).temperature
        if scored != manifest.scoring_temperature:
            findings.append(
                Finding.of(
                    C.TEMPERATURE_MISMATCH,
                    f"{side}: its manifest records scoring at temperature {scored!r}, the rollout's scoring "
                    f"temperature is {manifest.scoring_temperature!r}",
                    {"side": side, "recorded_temperature": scored, "scoring_temperature": manifest.scoring_temperature},
                )
            )
    return findings
