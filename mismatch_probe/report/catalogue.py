"""Every key of a comparison's `metrics` (SPEC section 5), declared once, in the order metrics.json writes them.

metrics.json's key order, the HTML report's tables, the gate's baseline keys, compare's and the demo's
columns and the key table of docs/metrics.md all read this list; adding a key touches only this file and the
accumulator that computes it. A family (`extreme_fraction@T`) is declared once under its pattern: the
part after `@` is a parameter, either given by the user (thresholds, caps, bounds) or one of fixed `values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch_probe.report.bootstrap import CI_SUFFIX

LOWER, HIGHER, NEITHER = "lower_is_better", "higher_is_better", "none"
BOOTSTRAP = "bootstrap over sequences"  # KEY_ci95 beside the key, see bootstrap.py
GROUPS = ("probability", "threshold", "routing", "correction", "count")


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


def _verl(name: str) -> dict[str, str]:
    return {"verl": f"rollout_corr/{name}"}


CATALOGUE: tuple[MetricKey, ...] = (
    MetricKey(
        name="n_tokens",
        definition="response tokens with a finite log-prob on both sides (the compared tokens)",
        unit="tokens",
        direction=NEITHER,
        group="probability",
    ),
    MetricKey(
        name="k3_kl",
        definition="mean of r - 1 - log r (Schulman's k3)",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="k1_kl",
        definition="mean of -log r",
        unit="nats",
        direction=NEITHER,
        group="probability",
        interval=BOOTSTRAP,
    ),
    MetricKey(
        name="k2_kl",
        definition="mean of 0.5 (log r)^2",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="abs_logprob_diff_mean",
        definition="mean of abs(delta)",
        unit="nats",
        direction=LOWER,
        group="probability",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="abs_logprob_diff_max", definition="max of abs(delta)", unit="nats", direction=LOWER, group="probability"
    ),
    MetricKey(
        name="abs_prob_diff_mean",
        definition="mean of abs(p_cand - p_ref)",
        unit="probability",
        direction=LOWER,
        group="probability",
    ),
    MetricKey(
        name="abs_prob_diff_max",
        definition="max of abs(p_cand - p_ref)",
        unit="probability",
        direction=LOWER,
        group="probability",
    ),
    MetricKey(
        name="extreme_fraction@T",
        definition="F(T): fraction of tokens with max(r, 1/r) > T (--thresholds)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="argmax_flip_rate",
        definition="fraction of response positions whose top_token_id differs (both sides have it)",
        unit="fraction",
        direction=LOWER,
        group="probability",
    ),
    MetricKey(name="n_response_tokens", definition="response tokens", unit="tokens", direction=NEITHER, group="count"),
    MetricKey(
        name="n_skipped",
        definition="response tokens not compared (n_response_tokens - n_tokens)",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_null_ref",
        definition="response tokens whose reference log-prob is null",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_null_cand",
        definition="response tokens whose candidate log-prob is null",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_nonfinite_ref",
        definition="response tokens whose reference log-prob is NaN or inf",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_nonfinite_cand",
        definition="response tokens whose candidate log-prob is NaN or inf",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_argmax_compared",
        definition="response positions with top_token_id on both sides",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="router_diff_rate",
        definition="fraction of (token, MoE layer) pairs whose expert sets differ",
        unit="fraction",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="router_diff_mean",
        definition="mean differing experts per (token, MoE layer): top_k - abs(S_ref & S_cand)",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="token_diff_rate",
        definition="fraction of tokens with a differing expert in some MoE layer",
        unit="fraction",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="token_diff_mean",
        definition="mean over tokens of the differing experts summed over layers",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="seq_router_diff_mean",
        definition="mean over sequences of the per-token differing-expert count",
        unit="experts",
        direction=LOWER,
        group="routing",
    ),
    MetricKey(
        name="n_routing_tokens",
        definition="tokens with routing on both sides (routing scope)",
        unit="tokens",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_routing_sequences",
        definition="sequences with routing on both sides",
        unit="sequences",
        direction=NEITHER,
        group="count",
    ),
    MetricKey(
        name="n_tokens@SPLIT",
        definition="compared tokens with routing on both sides whose expert sets are "
        "identical in every MoE layer (routing_same) / differ in one (routing_diff)",
        unit="tokens",
        direction=NEITHER,
        group="routing",
        values=("routing_same", "routing_diff"),
    ),
    MetricKey(
        name="k3_kl@SPLIT",
        definition="k3_kl over the n_tokens@SPLIT tokens",
        unit="nats",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        values=("routing_same", "routing_diff"),
    ),
    MetricKey(
        name="log_ppl_diff",
        definition="mean over sequences of -mean(delta)",
        unit="nats",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("log_ppl_diff"),
    ),
    MetricKey(
        name="log_ppl_abs_diff",
        definition="mean over sequences of abs(mean(delta))",
        unit="nats",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("log_ppl_abs_diff"),
        gate_baseline=True,
    ),
    MetricKey(
        name="ppl_ratio",
        definition="mean over sequences of exp(-mean(delta))",
        unit="ratio",
        direction=NEITHER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("ppl_ratio"),
    ),
    MetricKey(
        name="chi2_token",
        definition="mean of r^2 - 1, delta clamped to [-20, 20]",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("chi2_token"),
        gate_baseline=True,
    ),
    MetricKey(
        name="chi2_seq",
        definition="mean over sequences of exp(2 sum(delta)) - 1, the sum clamped to [-20, 20]",
        unit="ratio",
        direction=LOWER,
        group="correction",
        interval=BOOTSTRAP,
        peers=_verl("chi2_seq"),
        gate_baseline=True,
    ),
    # verl's rollout_is ESS caps r at C first: another definition, so not its name.
    MetricKey(
        name="is_ess",
        definition="(sum r)^2 / (n sum r^2): normalised effective sample size",
        unit="fraction",
        direction=HIGHER,
        group="correction",
        interval=BOOTSTRAP,
    ),
    MetricKey(
        name="tis_clip_fraction@C",
        definition="fraction of tokens with r > C (--tis-caps)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
    MetricKey(
        name="seq_geo_reject_fraction@T",
        definition="fraction of sequences with exp(abs(mean(delta))) > T (--geo-bounds)",
        unit="fraction",
        direction=LOWER,
        group="threshold",
        interval=BOOTSTRAP,
        gate_baseline=True,
    ),
)


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
