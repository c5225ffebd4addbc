"""The catalogue's second run: the routing keys of an MoE comparison, and k3 split by whether a token's
expert sets differ."""

from __future__ import annotations

from mismatch_probe.report.keys.families import K3_KL_SPLIT, N_TOKENS_SPLIT
from mismatch_probe.report.keys.levels import ROUTING_SPLITS
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, LOWER, NEITHER, MetricKey

ROUTING_KEYS: tuple[MetricKey, ...] = (
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
        name=N_TOKENS_SPLIT.pattern,
        definition="compared tokens with routing on both sides whose expert sets are "
        "identical in every MoE layer (routing_same) / differ in one (routing_diff)",
        unit="tokens",
        direction=NEITHER,
        group="routing",
        values=ROUTING_SPLITS,
    ),
    MetricKey(
        name=K3_KL_SPLIT.pattern,
        definition="k3_kl over the n_tokens@SPLIT tokens",
        unit="nats",
        direction=LOWER,
        group="routing",
        interval=BOOTSTRAP,
        values=ROUTING_SPLITS,
    ),
)
