"""Which comparisons `probe gate` checks when no --pair names them.

A run may hold diagnostic score sets beside the one the team trains with (rundir/roles.py): an fp32 pass, an
R3 replay, repeated passes, a quantized or truncated pass, sweep variants, the engine's own prefill. Each
measures a diagnosis, not the setup under test, so a limit meant for the matched pass should not fail on one.
Without --pair the gate checks every comparison that involves no diagnostic set; where every comparison involves
one, it checks them all (as before roles). A new policy's comparisons stay, whatever replay its θ_old set used:
only their staleness keys are gated (check.staleness_only). A comparison whose set's manifest cannot be read keeps being gated.
"""

from __future__ import annotations

import sys

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.layout import ROLLOUT, Run
from mismatch_probe.rundir.roles import DIAGNOSTIC_ROLES, POLICY

NOT_GATED = tuple(role for role in DIAGNOSTIC_ROLES if role != POLICY)
POLICY_KIND = "policy"  # a comparison's kind in metrics.json: a new policy against its θ_old set


def _diagnostic(run: Run, side: str, roles: dict[str, str | None]) -> bool:
    if side == ROLLOUT:
        return False
    if side not in roles:
        try:
            roles[side] = run.side_info(side).score_role
        except (ProbeError, OSError):  # a copied report without its score sets: nothing to tell by
            roles[side] = None
    return roles[side] in NOT_GATED


def default_scope(run: Run, comparisons: list[dict]) -> tuple[list[dict], list[dict]]:
    """(gated, left out): the comparisons that involve no diagnostic score set, and the others."""
    roles: dict[str, str | None] = {}
    gated, left_out = [], []
    for comp in comparisons:
        sides = (comp["reference"], comp["candidate"])
        staleness = comp.get("kind") == POLICY_KIND  # θ_old against θ_new, whatever θ_old's replay: its own limits
        (left_out if not staleness and any(_diagnostic(run, s, roles) for s in sides) else gated).append(comp)
    if not gated:
        return comparisons, []
    return gated, left_out


def say_left_out(left_out: list[dict]) -> None:
    """One line on stderr (stdout may be --json): what was not gated, and how to gate it."""
    if not left_out:
        return
    pairs = ", ".join(f"{c['reference']}:{c['candidate']}" for c in left_out)
    print(
        f"gate: {len(left_out)} comparison(s) of diagnostic score sets not gated ({pairs}); "
        "name one with --pair to gate it",
        file=sys.stderr,
    )
