"""Every headline number of metrics.json against a plain numpy recomputation from the whole Parquet tables
(no streaming, no per-sequence carry), and a few intervals against a numpy Poisson bootstrap."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from frames import with_null_rows

from mismatch_probe.frames.bootstrap import RESAMPLES, SEED, poisson_weights
from mismatch_probe.report.build import build_report
from mismatch_probe.rundir import parts as table_io
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

THRESHOLDS, CAPS, BOUNDS = ("1.5", "2", "3.0"), ("1.2", "2"), ("1.001", "1.05")
CAND = "scores/cand"
SHAPES = {"moe": dict(num_layers=3, top_k=2, num_experts=70), "dense": dict(num_layers=0, top_k=0, num_experts=0)}


def _side(directory) -> dict:
    """A side's columns as numpy, nulls as masks."""
    table = pa.concat_tables([pq.read_table(part) for part in sorted(directory.glob("part-*.parquet"))])
    out = {name: table.column(name).to_numpy() for name in ("sample_id", "position", "is_response")}
    for name in ("logprob", "top_token_id"):
        col = table.column(name).combine_chunks()
        out[name], out[f"{name}_valid"] = col.fill_null(0).to_numpy(), col.is_valid().to_numpy(zero_copy_only=False)
    experts = table.column("experts").combine_chunks()
    out["experts_valid"] = experts.is_valid().to_numpy(zero_copy_only=False)
    rows = experts.to_pylist()  # row by row, independent of the reader under test
    width = max((len(row) for row in rows if row is not None), default=1)
    out["experts"] = np.array([row if row is not None else [0] * width for row in rows]).reshape(-1)
    return out


def _null_some(directory, seed: int) -> None:
    """A tenth of the candidate's log-probs and routing null, as engines that lack them write."""
    rng = np.random.default_rng(seed)
    for part in sorted(directory.glob("part-*.parquet")):
        table = pq.read_table(part)
        for name in ("logprob", "experts"):
            i = table.schema.get_field_index(name)
            col = table.column(i).combine_chunks()
            mask = pa.array(col.is_null().to_numpy(zero_copy_only=False) | (rng.random(len(col)) < 0.1))
            new = with_null_rows(col, mask.to_numpy(zero_copy_only=False))
            table = table.set_column(i, table.schema.field(i), new)
        pq.write_table(table, part, row_group_size=23)  # row groups that cut sequences


def _sequence_sums(sample_id: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids, inverse = np.unique(sample_id, return_inverse=True)
    return ids, np.bincount(inverse, weights=values, minlength=len(ids))


def numpy_metrics(ref: dict, cand: dict, layers: int, top_k: int, scope: str) -> tuple[dict, dict]:
    """(headline values, per-sequence sums for the bootstrap)."""
    resp = ref["is_response"]
    lr, lc = ref["logprob"].astype(np.float64), cand["logprob"].astype(np.float64)
    ok_r, ok_c = resp & ref["logprob_valid"], resp & cand["logprob_valid"]
    use = ok_r & ok_c & np.isfinite(lr) & np.isfinite(lc)
    d = lc[use] - lr[use]
    n = len(d)
    r = np.exp(d)
    out = {
        "n_tokens": n,
        "k3_kl": np.mean(np.expm1(d) - d),
        "k1_kl": np.mean(-d),
        "k2_kl": np.mean(d**2 / 2),
        "abs_logprob_diff_mean": np.mean(np.abs(d)),
        "abs_logprob_diff_max": np.max(np.abs(d)),
        "abs_prob_diff_mean": np.mean(np.abs(np.exp(lc[use]) - np.exp(lr[use]))),
        "abs_prob_diff_max": np.max(np.abs(np.exp(lc[use]) - np.exp(lr[use]))),
        "abs_prob_diff_std": np.std(np.abs(np.exp(lc[use]) - np.exp(lr[use])), ddof=1),
        "prob_diff_std": np.std(np.exp(lc[use]) - np.exp(lr[use])),
        "prob_corr": np.corrcoef(np.exp(lr[use]), np.exp(lc[use]))[0, 1],
        "n_response_tokens": int(resp.sum()),
        "n_skipped": int(resp.sum()) - n,
        "n_null_ref": int((resp & ~ref["logprob_valid"]).sum()),
        "n_null_cand": int((resp & ~cand["logprob_valid"]).sum()),
        "n_nonfinite_ref": int((ok_r & ~np.isfinite(lr)).sum()),
        "n_nonfinite_cand": int((ok_c & ~np.isfinite(lc)).sum()),
        "chi2_token": np.mean(np.exp(2 * np.clip(d, -20, 20)) - 1),
        "is_ess": r.sum() ** 2 / (n * (r * r).sum()),
    }
    out |= {f"extreme_fraction@{t}": np.mean(np.maximum(r, 1 / r) > float(t)) for t in THRESHOLDS}
    out |= {f"tis_clip_fraction@{c}": np.mean(r > float(c)) for c in CAPS}
    both = resp & ref["top_token_id_valid"] & cand["top_token_id_valid"]
    out["n_argmax_compared"] = int(both.sum())
    out["argmax_flip_rate"] = np.mean(ref["top_token_id"][both] != cand["top_token_id"][both])
    valued = ok_r & ok_c  # a log-prob on both sides, finite or not
    out["logprob_bit_mismatch_count"] = int((ref["logprob"][valued] != cand["logprob"][valued]).sum())
    out["logprob_bit_mismatch_fraction"] = out["logprob_bit_mismatch_count"] / int(valued.sum())
    ids, seq_n = _sequence_sums(ref["sample_id"][use], np.ones(n))
    _, seq_d = _sequence_sums(ref["sample_id"][use], d)
    mean_d = seq_d / seq_n
    out |= {f"seq_geo_reject_fraction@{b}": np.mean(np.exp(np.abs(mean_d)) > float(b)) for b in BOUNDS}
    out["mult_prob_error"] = np.mean(np.exp(np.abs(d)))
    every = np.unique(ref["sample_id"])  # verl's rows: every sequence, an empty response too
    verl, mean_d_every = verl_by_loops(every, ref["sample_id"][use], d, lr[use], lc[use])
    out |= verl
    sequences = {
        "ids": ids,
        "n": seq_n,
        "k3": _sequence_sums(ref["sample_id"][use], np.expm1(d) - d)[1],
        "every": every,
        "mean_d_every": mean_d_every,
    }
    if layers:
        out |= _routing(ref, cand, layers, top_k, scope, use, d, sequences)
    return out, sequences


def verl_by_loops(every, sid, d, lr, lc) -> tuple[dict, np.ndarray]:
    """verl 0.9.1's rollout_corr metrics, one sequence at a time: an empty sequence has mean 0 and sum 0."""
    per = []
    for sample in every:
        mine = sid == sample
        dd, n = d[mine], int(mine.sum())
        means = [x.sum() / n if n else 0.0 for x in (dd, lr[mine], lc[mine])]
        per.append({"n": n, "d": dd, "mean_d": means[0], "mean_lr": means[1], "mean_lc": means[2]})
    neg_mean = np.array([-p["mean_d"] for p in per])
    out = {
        "log_ppl_diff": np.mean(neg_mean),
        "log_ppl_abs_diff": np.mean(np.abs(neg_mean)),
        "log_ppl_diff_max": np.max(neg_mean),
        "log_ppl_diff_min": np.min(neg_mean),
        "ppl_ratio": np.mean(np.exp(neg_mean)),
        "chi2_seq": np.mean([np.exp(2 * np.clip(p["d"].sum(), -20, 20)) for p in per]) - 1,
        "ppl_ref": np.mean([np.exp(-p["mean_lr"]) for p in per]),
        "ppl_cand": np.mean([np.exp(-p["mean_lc"]) for p in per]),
        "log_ppl_ref": np.mean([-p["mean_lr"] for p in per]),
        "log_ppl_cand": np.mean([-p["mean_lc"] for p in per]),
    }
    raw = np.exp(np.clip(d, -20, 20))
    for label in CAPS:
        cap = float(label)
        w = np.minimum(raw, cap)
        x = np.array([np.minimum(np.exp(np.clip(p["d"], -20, 20)), cap).mean() if p["n"] else 0.0 for p in per])
        x_raw = np.array([np.exp(np.clip(p["d"], -20, 20)).mean() if p["n"] else 0.0 for p in per])
        out |= {
            f"is_ess@{label}": w.sum() ** 2 / (len(w) * (w * w).sum()),
            f"is_mean@{label}": w.mean(),
            f"is_std@{label}": w.std(),
            f"is_min@{label}": w.min(),
            f"is_max@{label}": w.max(),
            f"is_fraction_low@{label}": np.mean(raw < 1 / cap),
            f"icepop_oob_fraction@{label}": np.mean((raw < 1 / cap) | (raw > cap)),
            f"is_seq_mean@{label}": x.mean(),
            f"is_seq_std@{label}": x.std(ddof=1),
            f"is_seq_min@{label}": x.min(),
            f"is_seq_max@{label}": x.max(),
            f"is_seq_max_deviation@{label}": np.abs(x - 1).max(),
            f"is_seq_fraction_high@{label}": np.mean(x_raw > cap),
            f"is_seq_fraction_low@{label}": np.mean(x_raw < 1 / cap),
            f"seq_tis_clip_fraction@{label}": np.mean([p["d"].sum() > np.log(cap) for p in per]),
            **_sequence_weights(per, cap, label),
        }
    modes = _rejection_statistics([np.clip(p["d"], -20, 20) for p in per if p["n"]])
    for label in BOUNDS:
        for mode in ("seq_mean_k1", "seq_sum_k1"):
            outside = [k < np.log(1 / float(label)) or k > np.log(float(label)) for k in modes[mode]]
            out[f"{mode}_reject_fraction@{label}"] = np.mean(outside)
    for mode, stat in modes.items():
        tokens = np.array([p["n"] for p in per if p["n"]])
        out |= {
            f"rs_mean@{mode}": (stat * tokens).sum() / tokens.sum(),
            f"rs_seq_mean@{mode}": stat.mean(),
            f"rs_seq_std@{mode}": stat.std(ddof=1),
            f"rs_seq_max@{mode}": stat.max(),
            f"rs_seq_min@{mode}": stat.min(),
            f"rs_seq_max_deviation@{mode}": np.abs(stat).max(),
        }
    return out, -neg_mean


def _sequence_weights(per: list[dict], cap: float, label: str) -> dict:
    """verl's rollout_is: sequence: each token carries its sequence's weight min(exp(clamped sum), C)."""
    w = np.concatenate([np.full(p["n"], min(np.exp(np.clip(p["d"].sum(), -20, 20)), cap)) for p in per])
    sums = np.array([p["d"].sum() for p in per])  # unclamped; an empty sequence's is 0
    return {
        f"seq_is_max@{label}": np.exp(min(sums.max(), 20)),
        f"seq_is_min@{label}": np.exp(sums.min()),
        f"seq_is_mean@{label}": w.mean(),
        f"seq_is_std@{label}": w.std(),
        f"seq_is_ess@{label}": w.sum() ** 2 / (len(w) * (w * w).sum()),
        f"seq_is_fraction_low@{label}": np.mean([p["d"].sum() < np.log(1 / cap) for p in per]),
    }


def _rejection_statistics(safe: list[np.ndarray]) -> dict[str, np.ndarray]:
    """verl's rejection statistic per non-empty sequence, from its clamped deltas, token by token."""
    k = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: np.exp(x) - 1 - x}
    out = {}
    for name, f in k.items():
        out[f"seq_sum_{name}"] = np.array([sum(f(x) for x in s) for s in safe])
        out[f"seq_mean_{name}"] = np.array([sum(f(x) for x in s) / len(s) for s in safe])
        if name != "k1":
            out[f"seq_max_{name}"] = np.array([max(f(x) for x in s) for s in safe])
    return out


def _routing(ref, cand, layers, top_k, scope, use, d, sequences) -> dict:
    rows = ref["experts_valid"] & cand["experts_valid"] & (ref["is_response"] if scope == "response" else True)
    a = ref["experts"].reshape(-1, layers, top_k)[rows]
    b = cand["experts"].reshape(-1, layers, top_k)[rows]
    diff = top_k - (a[..., :, None] == b[..., None, :]).any(axis=-1).sum(axis=-1)  # [tokens, layers]
    per_token = diff.sum(axis=1)
    ids, seq_sum = _sequence_sums(ref["sample_id"][rows], per_token)
    _, seq_tokens = _sequence_sums(ref["sample_id"][rows], np.ones(len(per_token)))
    differs = np.zeros(len(rows), bool)
    differs[np.flatnonzero(rows)[(diff > 0).any(axis=1)]] = True
    k3 = np.expm1(d) - d
    # token p is judged by routing row p - 1 (the forward that scored it), when that row is its sample's
    follows = np.r_[
        False, (ref["sample_id"][1:] == ref["sample_id"][:-1]) & (np.diff(ref["position"].astype(np.int64)) == 1)
    ]
    both = ref["experts_valid"] & cand["experts_valid"]  # row p - 1 judges token p whatever the routing scope
    full = ref["experts"].reshape(-1, layers, top_k), cand["experts"].reshape(-1, layers, top_k)
    any_diff = (np.sort(full[0], axis=-1) != np.sort(full[1], axis=-1)).any(axis=(1, 2)) & both
    before_rows, before_differs = np.r_[False, both[:-1]] & follows, np.r_[False, any_diff[:-1]]
    same, changed = (before_rows & ~before_differs)[use], (before_rows & before_differs)[use]
    _, seq_routed = _sequence_sums(ref["sample_id"][rows], np.ones(rows.sum()))
    _, seq_layers = _sequence_sums(ref["sample_id"][rows], (diff > 0).sum(axis=1))
    sequences |= {"routed_ids": ids, "routed": seq_routed, "layers": seq_layers}
    return {
        "router_diff_rate": np.mean(diff > 0),
        "router_diff_mean": np.mean(diff),
        "token_diff_rate": np.mean(per_token > 0),
        "token_diff_mean": np.mean(per_token),
        "seq_router_diff_mean": np.mean(seq_sum / seq_tokens),
        "n_routing_tokens": int(rows.sum()),
        "n_routing_sequences": len(ids),
        "n_tokens@routing_same": int(same.sum()),
        "n_tokens@routing_diff": int(changed.sum()),
        "k3_kl@routing_same": np.mean(k3[same]),
        "k3_kl@routing_diff": np.mean(k3[changed]),
    }


def _bootstrap(ids: np.ndarray, statistic) -> list[float]:
    """The percentile interval of `statistic(weights)` under the report's Poisson weights, [resamples] at once."""
    weights = poisson_weights(ids, SEED, RESAMPLES)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(weights)
    values = values[np.isfinite(values)]
    return np.quantile(values, [0.025, 0.975]).tolist()


@pytest.mark.parametrize("kind, scope", [("moe", "all"), ("moe", "response"), ("dense", "all")])
def test_every_headline_number_against_numpy(tmp_path, monkeypatch, kind, scope):
    spec = SyntheticSpec(
        **SHAPES[kind],
        n_samples=50,
        prompt_len=(2, 8),
        response_len=(0, 30),
        seed=4,
        score_sets=(
            ScoreSetSpec("cand", logprob_sigma=0.5, route_fraction=0.2, shuffle_order=True, nonfinite_fraction=0.05),
        ),
    )
    root = write_synthetic_run(tmp_path / "run", spec)
    _null_some(root / CAND, seed=1)
    monkeypatch.setattr(table_io, "BATCH_ROWS", 64)  # many chunks
    report = build_report(
        root,
        pairs=[("rollout", CAND)],
        thresholds=THRESHOLDS,
        tis_caps=CAPS,
        geo_bounds=BOUNDS,
        routing_scope=scope,
        render=False,
    )
    got = report.metrics["comparisons"][0]["metrics"]
    want, sequences = numpy_metrics(_side(root / "rollout"), _side(root / CAND), spec.num_layers, spec.top_k, scope)
    headline = {key for key in got if not key.endswith("_ci95")}
    routing_nulls = {
        "router_diff_rate",
        "router_diff_mean",
        "token_diff_rate",
        "token_diff_mean",
        "seq_router_diff_mean",
        "n_tokens@routing_same",
        "n_tokens@routing_diff",
        "k3_kl@routing_same",
        "k3_kl@routing_diff",
    }
    if kind == "dense":
        assert all(got[key] is None for key in routing_nulls)
        headline -= routing_nulls
    assert headline == set(want)  # every number is checked, and nothing is missing
    for key in sorted(headline):
        if isinstance(want[key], int):
            assert got[key] == want[key] and type(got[key]) is int, key
        else:
            assert got[key] == pytest.approx(float(want[key]), rel=1e-10, abs=1e-14), key

    # Intervals: the percentile interval of the same totals under the same weights, not widened.
    n, k3, mean_d = sequences["n"], sequences["k3"], sequences["mean_d_every"]
    assert got["k3_kl_ci95"] == pytest.approx(_bootstrap(sequences["ids"], lambda w: (k3 @ w) / (n @ w)), rel=1e-10)
    ones = np.ones(len(mean_d))
    log_ppl = _bootstrap(sequences["every"], lambda w: (-mean_d @ w) / (ones @ w))
    assert got["log_ppl_diff_ci95"] == pytest.approx(log_ppl, rel=1e-10)
    if kind == "moe":
        routed, layers = sequences["routed"], sequences["layers"]
        rate = _bootstrap(sequences["routed_ids"], lambda w: (layers @ w) / (spec.num_layers * routed @ w))
        assert got["router_diff_rate_ci95"] == pytest.approx(rate, rel=1e-10)
