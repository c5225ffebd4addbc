"""What the catalogue declares of a metric key (catalogue.py lists them): its definition, unit, direction,
report table, interval and peers' names."""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch_probe.frames.bootstrap import CI_SUFFIX

LOWER, HIGHER, NEITHER = "lower_is_better", "higher_is_better", "none"
BOOTSTRAP = "bootstrap over sequences"  # KEY_ci95 beside the key, see bootstrap.py
GROUPS = ("probability", "threshold", "routing", "correction", "verl", "count", "policy")
# The frameworks of the key rosetta (`probe keys`), in its column order.
PEERS = ("verl", "slime/miles", "NeMo-RL", "prime-rl")


@dataclass(frozen=True)
class MetricKey:
    name: str  # the exact key, or a family's pattern: "extreme_fraction@T"
    definition: str  # formula text; delta = logprob_cand - logprob_ref, r = exp(delta), over compared tokens
    unit: str
    direction: str  # LOWER, HIGHER or NEITHER (signed, or a count)
    group: str  # one of GROUPS: the table of the HTML report it lands in
    interval: str = NEITHER  # BOOTSTRAP where the report writes KEY_ci95
    # Peers' name for exactly this definition (SPEC: a key that shares a peer's name computes the peer's
    # definition). Frameworks not listed log no metric of this definition that we know of.
    peers: dict[str, str] = field(default_factory=dict)
    # What a reader of a peer's logs should know: the nearest peer metric and how it differs.
    note: str = ""
    # The gate's default: compared with a --baseline run when --max names no key with an interval.
    # No key has a default limit: limits are the user's.
    gate_baseline: bool = False
    values: tuple[str, ...] = ()  # a family's fixed parameters; empty: the user's (--thresholds, ...)

    @property
    def prefix(self) -> str | None:
        """`extreme_fraction@` for a family, None for a plain key."""
        head, at, _ = self.name.partition("@")
        return head + at if at else None

    def names(self) -> tuple[str, ...]:
        """The concrete keys: the name, or each fixed value of a family (none for a user-parameter family)."""
        if self.prefix is None:
            return (self.name,)
        return tuple(self.prefix + value for value in self.values)

    def matches(self, key: str) -> bool:
        """Whether `key` is this key, or one of this family's (not its interval, `extreme_fraction@2_ci95`)."""
        if self.prefix is None or not key.startswith(self.prefix):
            return key == self.name
        return key in self.names() if self.values else not key.endswith(CI_SUFFIX)


def verl_peer(name: str, config: str = "") -> dict[str, str]:
    """MetricKey.peers for a key verl logs under rollout_corr/NAME (with CONFIG, the settings that log it)."""
    return {"verl": f"rollout_corr/{name}{config}"}
