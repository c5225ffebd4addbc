"""The key catalogue against what reports really write, the README's key table, and metrics.json's one reader."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.frames.bootstrap import CI_SUFFIX
from mismatch_probe.gate.stats import baseline_keys
from mismatch_probe.report.build import build_report
from mismatch_probe.report.keys import families
from mismatch_probe.report.keys.catalogue import CATALOGUE, checked, declared, names, rank
from mismatch_probe.report.keys.correction_keys import CORRECTION_KEYS
from mismatch_probe.report.keys.families import EXTREME_FRACTION, Family
from mismatch_probe.report.keys.metric_key import BOOTSTRAP, PEERS
from mismatch_probe.report.keys.policy_keys import POLICY_KEYS
from mismatch_probe.report.keys.routing_keys import ROUTING_KEYS
from mismatch_probe.report.keys.token_keys import TOKEN_KEYS
from mismatch_probe.report.metrics_file import read_metrics
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

ROOT = Path(__file__).resolve().parents[1]
# The catalogue's order when it was one tuple (before issue 39 split it into its four runs), run by run.
RUN_ORDER = (
    """n_tokens k3_kl k1_kl k2_kl abs_logprob_diff_mean abs_logprob_diff_max abs_prob_diff_mean abs_prob_diff_max
    abs_prob_diff_std prob_diff_std prob_corr kept_logmass_diff_mean extreme_fraction@T argmax_flip_rate logprob_bit_mismatch_fraction
    logprob_bit_mismatch_count n_response_tokens n_skipped n_null_ref n_null_cand n_nonfinite_ref n_nonfinite_cand
    n_outside_support n_argmax_compared""",
    """router_diff_rate router_diff_mean token_diff_rate token_diff_mean seq_router_diff_mean n_routing_tokens
    n_routing_sequences n_tokens@SPLIT k3_kl@SPLIT""",
    """log_ppl_diff log_ppl_diff_max log_ppl_diff_min log_ppl_abs_diff ppl_ratio ppl_ref ppl_cand log_ppl_ref
    log_ppl_cand chi2_token chi2_seq mult_prob_error is_ess is_ess@C is_mean@C is_std@C is_min@C is_max@C
    is_fraction_low@C is_seq_mean@C is_seq_std@C is_seq_min@C is_seq_max@C is_seq_max_deviation@C
    is_seq_fraction_high@C is_seq_fraction_low@C tis_clip_fraction@C seq_is_ess@C seq_is_mean@C seq_is_std@C
    seq_is_fraction_low@C seq_is_max@C seq_is_min@C icepop_oob_fraction@C seq_tis_clip_fraction@C rs_mean@MODE
    rs_seq_mean@MODE rs_seq_std@MODE rs_seq_max@MODE rs_seq_min@MODE rs_seq_max_deviation@MODE
    seq_geo_reject_fraction@T seq_mean_k1_reject_fraction@T seq_sum_k1_reject_fraction@T""",
    """n_policy_tokens tid_k3_kl total_k3_kl tid_log_ratio_var stale_log_ratio_var tid_stale_log_ratio_cov
    total_log_ratio_var replay_bias_k3_kl replay_bias_mean router_shift_delta_mean router_shift_ratio_mean
    router_shift_clip_fraction@G replay_override_rate ppo_ratio_below_fraction@B ppo_ratio_above_fraction@B
    rspo_ratio_below_fraction@B rspo_ratio_above_fraction@B total_tis_clip_fraction@C""",
)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    base = tmp_path_factory.mktemp("catalogue")
    shapes = {"moe": dict(num_layers=2, top_k=2, num_experts=8), "dense": dict(num_layers=0, top_k=0, num_experts=0)}
    out = {}
    for kind, shape in shapes.items():
        # the MoE run's sides record kept_logmass (a truncated rollout and a --sampling rollout pass): its keys too
        moe = kind == "moe"
        score_sets = (ScoreSetSpec(name="a", kept_logmass=moe, outside_support_fraction=0.1 if moe else 0.0),)
        spec = SyntheticSpec(n_samples=8, response_len=(4, 12), score_sets=score_sets, kept_logmass=moe, **shape)
        root = write_synthetic_run(base / kind, spec)
        out[kind] = build_report(
            root, thresholds=["1.5", "3"], tis_caps=["2"], geo_bounds=["1.01"], render=False
        ).metrics
    return out


def _keys(metrics: dict) -> list[str]:
    return [key for comp in metrics["comparisons"] for key in comp["metrics"]]


def test_every_key_a_report_writes_is_declared(reports):
    for kind, metrics in reports.items():
        for key in _keys(metrics):
            entry = declared(key.removesuffix(CI_SUFFIX))
            assert entry is not None, f"{kind}: {key} is not in the catalogue"
            if key.endswith(CI_SUFFIX):
                assert entry.interval == BOOTSTRAP, f"{kind}: {key} written but {entry.name} declares no interval"


def test_every_declared_key_is_in_a_moe_report(reports):
    """Every key but a policy comparison's (tests/test_policy.py checks those on a real policy run)."""
    written = set(_keys(reports["moe"]))
    assert set(names()) - set(names("policy")) <= written
    for entry in (e for e in CATALOGUE if e.group != "policy"):  # user-parameter families: the levels asked for
        assert any(entry.matches(key) for key in written), entry.name
        for key in filter(entry.matches, written):
            assert (key + CI_SUFFIX in written) == (entry.interval == BOOTSTRAP), key


def test_metrics_json_is_in_catalogue_order(reports):
    for metrics in reports.values():
        for comp in metrics["comparisons"]:
            ranks = [rank(key.removesuffix(CI_SUFFIX)) for key in comp["metrics"]]
            assert ranks == sorted(ranks)
    keys = list(reports["moe"]["comparisons"][0]["metrics"])
    assert keys[:4] == ["n_tokens", "k3_kl", "k3_kl_ci95", "k1_kl"]
    assert keys.index("n_tokens@routing_diff") < keys.index("k3_kl@routing_same") < keys.index("log_ppl_diff")
    assert keys[-6:] == [
        "seq_geo_reject_fraction@1.01",
        "seq_geo_reject_fraction@1.01_ci95",
        "seq_mean_k1_reject_fraction@1.01",
        "seq_mean_k1_reject_fraction@1.01_ci95",
        "seq_sum_k1_reject_fraction@1.01",
        "seq_sum_k1_reject_fraction@1.01_ci95",
    ]


def test_the_four_runs_joined_keep_the_catalogue_s_order():
    runs = (TOKEN_KEYS, ROUTING_KEYS, CORRECTION_KEYS, POLICY_KEYS)
    assert [[entry.name for entry in run] for run in runs] == [order.split() for order in RUN_ORDER]
    assert CATALOGUE == tuple(entry for run in runs for entry in run)


def test_each_family_is_named_once_in_families_and_declared_under_that_name():
    named = [value for value in vars(families).values() if isinstance(value, Family)]
    named += [
        family for sides in (families.PPO_RATIO_FRACTION, families.RSPO_RATIO_FRACTION) for family in sides.values()
    ]
    patterns = [family.pattern for family in named]
    assert sorted(patterns) == sorted(entry.name for entry in CATALOGUE if entry.prefix)
    assert EXTREME_FRACTION.at(2.0) == "extreme_fraction@2" and EXTREME_FRACTION.at(" 2.50") == "extreme_fraction@2.50"
    assert EXTREME_FRACTION.level_of("extreme_fraction@1.5_ci95") == "1.5_ci95"
    assert EXTREME_FRACTION.level_of("k3_kl") is None


def test_baseline_keys_are_the_higher_is_worse_ones(reports):
    got = baseline_keys(reports["moe"]["comparisons"], [])
    assert got == [
        "k3_kl",
        "k2_kl",
        "abs_logprob_diff_mean",
        "extreme_fraction@1.5",
        "extreme_fraction@3",
        "router_diff_rate",
        "token_diff_rate",
        "log_ppl_abs_diff",
        "chi2_token",
        "chi2_seq",
        "tis_clip_fraction@2",
        "seq_geo_reject_fraction@1.01",
    ]


def test_family_interval_is_not_a_family_key():
    assert declared("extreme_fraction@2").name == "extreme_fraction@T"
    assert declared("extreme_fraction@2_ci95") is None
    assert declared("k3_kl@routing_same").name == "k3_kl@SPLIT" and declared("k3_kl@routing_other") is None


def test_presentation_lists_must_name_declared_keys():
    assert checked("k3_kl", "extreme_fraction@2") == ("k3_kl", "extreme_fraction@2")
    with pytest.raises(ValueError, match="keys not in the catalogue: k3_kll"):
        checked("k3_kl", "k3_kll")


def test_peer_names_only_where_the_definition_is_the_peer_s():
    """Every key carrying verl's name is checked against verl itself (tests/test_verl_parity.py); the others
    are the names whose definition was read in the peer's source."""
    verl = {entry.name: entry.peers["verl"] for entry in CATALOGUE if "verl" in entry.peers}
    assert set(verl) == {
        "k3_kl",
        "k1_kl",
        "log_ppl_diff",
        "log_ppl_diff_max",
        "log_ppl_diff_min",
        "log_ppl_abs_diff",
        "ppl_ratio",
        "ppl_ref",
        "ppl_cand",
        "log_ppl_ref",
        "log_ppl_cand",
        "chi2_token",
        "chi2_seq",
        *(f"{name}@C" for name in ("is_ess", "is_mean", "is_std", "is_min", "is_max", "is_fraction_low")),
        *(f"is_seq_{name}@C" for name in ("mean", "std", "min", "max", "max_deviation", "fraction_high")),
        "is_seq_fraction_low@C",
        "tis_clip_fraction@C",
        "seq_tis_clip_fraction@C",
        "icepop_oob_fraction@C",
        *(f"seq_is_{name}@C" for name in ("ess", "mean", "std", "fraction_low", "max", "min")),
        *(f"abs_prob_diff_{stat}" for stat in ("mean", "max", "std")),
        "prob_corr",
        "logprob_bit_mismatch_count",
        "seq_mean_k1_reject_fraction@T",
        "seq_sum_k1_reject_fraction@T",
        *(f"rs_{stat}@MODE" for stat in ("mean", "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation")),
    }
    assert verl["ppl_cand"] == "rollout_corr/training_ppl" and verl["log_ppl_ref"] == "rollout_corr/rollout_log_ppl"
    assert "verl" not in declared("is_ess").peers and "is_ess@C" in declared("is_ess").note
    assert not declared("seq_geo_reject_fraction@2").peers and not declared("k2_kl").peers
    others = {(entry.name, peer) for entry in CATALOGUE for peer in entry.peers if peer != "verl"}
    assert others == {
        ("k3_kl", "NeMo-RL"),
        ("k3_kl", "prime-rl"),
        ("mult_prob_error", "NeMo-RL"),
        ("logprob_bit_mismatch_fraction", "prime-rl"),
    }
    assert all(set(entry.peers) <= set(PEERS) for entry in CATALOGUE)


def test_readme_key_table_is_the_script_s_output():
    printed = runpy.run_path(str(ROOT / "scripts" / "key_table.py"))["key_table"]()
    readme = (ROOT / "docs" / "metrics.md").read_text()  # the README links it
    (table,) = re.findall(r"<!-- keys:begin -->\n(.*?)\n<!-- keys:end -->", readme, re.S)
    assert table == printed
    assert all(f"`{entry.name}`" in table for entry in CATALOGUE)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"k3_kl": "low"}, "k3_kl is 'low', expected a number or null"),
        ({"k3_kl": True}, "k3_kl is True, expected a number or null"),
        ({"k3_kl": 0.1, "k3_kl_ci95": [0.1]}, "k3_kl_ci95 is [0.1], expected [low, high]"),
        ({"k3_kl": 0.1, "k3_kl_ci95": [0.0, "x"]}, "k3_kl_ci95 is [0.0, 'x'], expected [low, high]"),
    ],
)
def test_read_metrics_checks_every_value(tmp_path, value, message):
    """One reader checks every metric of metrics.json, so gate and compare take numbers as numbers."""
    path = tmp_path / "metrics.json"
    comp = {"reference": "rollout", "candidate": "scores/a", "metrics": {"n_tokens": 3, **value}}
    path.write_text(json.dumps({"schema_version": 1, "comparisons": [comp]}))
    with pytest.raises(ProbeError) as caught:
        read_metrics(path, tmp_path)
    assert str(caught.value) == f"{path}: rollout vs scores/a: {message}"
    comp["metrics"] = {"n_tokens": 3, "k3_kl": None, "k3_kl_ci95": None, "k2_kl": 1, "k2_kl_ci95": [0, 2.5]}
    path.write_text(json.dumps({"schema_version": 1, "comparisons": [comp]}))
    assert read_metrics(path, tmp_path)["comparisons"][0]["metrics"]["k2_kl_ci95"] == [0, 2.5]
