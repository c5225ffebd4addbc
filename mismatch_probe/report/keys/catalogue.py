"""Every key of a comparison's `metrics` (SPEC section 5), declared once, in the order metrics.json writes them.

metrics.json's key order, the HTML report's tables, the gate's baseline keys, compare's and the demo's
columns and the key table of docs/metrics.md all read this list; adding a key touches only the run that
declares it (token_keys.py, routing_keys.py, correction_keys.py, policy_keys.py) and the accumulator that
computes it. A family (`extreme_fraction@T`) is declared once under its pattern (families.py): the part after
`@` is a parameter, either given by the user (thresholds, caps, bounds) or one of fixed `values` (levels.py).
"""

from __future__ import annotations

from mismatch_probe.report.keys.correction_keys import CORRECTION_KEYS
from mismatch_probe.report.keys.metric_key import MetricKey
from mismatch_probe.report.keys.policy_keys import POLICY_KEYS
from mismatch_probe.report.keys.routing_keys import ROUTING_KEYS
from mismatch_probe.report.keys.token_keys import TOKEN_KEYS

# Four runs, in metrics.json's order: every comparison's per-token keys, an MoE comparison's routing keys, the
# correction what-ifs, then a policy comparison's own keys.
CATALOGUE: tuple[MetricKey, ...] = TOKEN_KEYS + ROUTING_KEYS + CORRECTION_KEYS + POLICY_KEYS


def declared(key: str) -> MetricKey | None:
    """The declaration of a concrete key (`extreme_fraction@2` -> the extreme_fraction@T family), or None."""
    return next((entry for entry in CATALOGUE if entry.matches(key)), None)


def rank(key: str) -> tuple[int, int]:
    """Place of a key in the catalogue (a fixed family's values in their order); undeclared keys last."""
    for i, entry in enumerate(CATALOGUE):
        if entry.matches(key):
            return i, entry.names().index(key) if entry.values else 0
    return len(CATALOGUE), 0


def names(group: str | None = None) -> tuple[str, ...]:
    """Concrete keys declared (of one group), in catalogue order; user-parameter families have none."""
    return tuple(name for entry in CATALOGUE if group in (None, entry.group) for name in entry.names())


def checked(*keys: str) -> tuple[str, ...]:
    """`keys` after making sure each is declared: a presentation choice (columns shown by default) that
    names a key the report never writes is a bug to catch at import."""
    unknown = [key for key in keys if declared(key) is None]
    if unknown:
        raise ValueError(f"keys not in the catalogue: {', '.join(unknown)}")
    return keys
