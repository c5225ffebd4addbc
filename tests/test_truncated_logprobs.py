"""Truncated sampling (issue 40): `probe generate --logprobs-mode processed`, the `kept_logmass` column, the
`sampling` entry of both manifests, and `probe rescore --sampling rollout`, each against a direct implementation
(numpy on the logits of a plain transformers forward of the stored ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.base import Truncation
from mismatch_probe.engines.forward.truncation import kept_support, truncated_logprobs
from mismatch_probe.schema import KEPT_LOGMASS

DEMO_MOE = Path(__file__).resolve().parents[1] / "mismatch_probe" / "data" / "models" / "moe"
TOP_P = 0.7


def probe(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def support_numpy(scaled: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """One row's support, written out plainly: top-k by value (ties kept), then top-p on the renormalised rest."""
    keep = np.ones(scaled.shape, dtype=bool)
    if 0 < top_k < len(scaled):
        keep = scaled >= np.sort(scaled)[::-1][top_k - 1]
    if top_p < 1:
        masked = np.where(keep, scaled.astype(np.float64), -np.inf)
        probs = np.exp(masked - masked.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = 0.0
        in_p = np.zeros_like(keep)
        for rank, token in enumerate(order):
            if rank > 0 and mass_before >= top_p:
                break
            in_p[token] = True
            mass_before += probs[token]
        keep &= in_p
    return keep


def log_mass(scaled: np.ndarray, keep: np.ndarray) -> float:
    s = scaled.astype(np.float64)
    top = s.max()
    return float(np.log(np.exp(s[keep] - top).sum()) - np.log(np.exp(s - top).sum()))


@pytest.mark.parametrize("top_p, top_k", [(0.7, 0), (1.0, 5), (0.5, 8), (0.95, 0), (0.0, 0)])
def test_support_and_kept_mass_match_a_direct_implementation(top_p, top_k):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 300, generator=generator) * 3
    logits[0, :4] = 10.0  # a tie at the top
    temperature = 0.8
    truncation = Truncation(top_p=top_p, top_k=top_k)
    keep = kept_support(logits / temperature, truncation).numpy()
    targets = torch.randint(0, 300, (64,), generator=generator)
    logprob, top_id, top_logprob, kept = (
        t.numpy() for t in truncated_logprobs(logits, targets, temperature, truncation)
    )
    scaled = (logits / temperature).numpy()
    raw = torch.log_softmax(logits / temperature, dim=-1).numpy()
    for row in range(64):
        expected = support_numpy(scaled[row], top_p, top_k)
        assert np.array_equal(keep[row], expected), row
        assert kept[row] == pytest.approx(log_mass(scaled[row], expected), abs=2e-6)
        target = int(targets[row])
        if expected[target]:
            assert logprob[row] == pytest.approx(raw[row, target] - kept[row], abs=2e-6)
        else:
            assert logprob[row] == -np.inf
        assert expected[top_id[row]] and top_logprob[row] == pytest.approx(raw[row].max() - kept[row], abs=2e-6)
    assert (kept <= 0).all()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("truncation")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(8)) + "\n")
    common = ["--model", DEMO_MOE, "--prompts", prompts, "--max-new-tokens", 12, "--seed", 5, "--dtype", "fp32"]
    common += ["--top-p", TOP_P, "--temperature", 0.9, "--batch-size", 8]
    for mode in ("raw", "processed"):
        result = probe("generate", *common, "--out", root / mode, "--logprobs-mode", mode)
        assert result.exit_code == 0, result.output
    return root


def table(path: Path) -> pl.DataFrame:
    return pl.read_parquet(path / "*.parquet").sort("sample_id", "position")


def forward_logits(token_ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MOE, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(token_ids.astype(np.int64))[None]).logits[0].numpy()


def test_processed_logprobs_are_raw_minus_kept_logmass(runs):
    raw, processed = table(runs / "raw" / "rollout"), table(runs / "processed" / "rollout")
    assert raw["token_id"].to_list() == processed["token_id"].to_list()  # one support rule, one sample
    response = processed.filter(pl.col("is_response"))
    kept = response[KEPT_LOGMASS].to_numpy()
    assert response[KEPT_LOGMASS].null_count() == 0 and (kept <= 0).all() and (kept < -1e-3).any()
    raw_response = raw.filter(pl.col("is_response"))
    assert np.array_equal(raw_response[KEPT_LOGMASS].to_numpy(), kept)  # raw mode writes the kept mass too
    # exactly: the processed log-prob is the float32 difference of the raw one and the log kept mass
    expected = (raw_response["logprob"].to_numpy() - kept).astype(np.float32)
    assert np.array_equal(response["logprob"].to_numpy(), expected)
    assert processed.filter(~pl.col("is_response"))[KEPT_LOGMASS].null_count() == len(
        processed.filter(~pl.col("is_response"))
    )
    # against a plain forward of the stored ids (no KV cache): raw log-prob and the kept mass of the support
    for sample in processed.partition_by("sample_id", maintain_order=True)[:3]:
        ids = sample["token_id"].to_numpy()
        logits = forward_logits(ids) / 0.9
        for row in sample.filter(pl.col("is_response")).iter_rows(named=True):
            scaled = logits[row["position"] - 1]
            keep = support_numpy(scaled, TOP_P, 0)
            assert keep[row["token_id"]]  # sampled from the support it records
            s = scaled.astype(np.float64)
            raw_lp = s[row["token_id"]] - np.log(np.exp(s - s.max()).sum()) - s.max()
            assert row[KEPT_LOGMASS] == pytest.approx(log_mass(scaled, keep), abs=1e-4)
            assert row["logprob"] == pytest.approx(raw_lp - row[KEPT_LOGMASS], abs=1e-4)


def test_rollout_manifests_record_sampling(runs):
    for mode in ("raw", "processed"):
        sampling = json.loads((runs / mode / "manifest.json").read_text())["sampling"]
        assert sampling["temperature"] == 0.9 and sampling["top_p"] == TOP_P and sampling["top_k"] == 0
        assert sampling["logprobs_mode"] == mode


def test_rescore_with_the_rollouts_sampling(runs):
    run = runs / "processed"
    manifest_path = run / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    top_p = 0.3  # narrower than the rollout sampled from, so that some sampled tokens fall outside
    manifest["sampling"]["top_p"] = top_p
    manifest_path.write_text(json.dumps(manifest))
    for args in (("--name", "plain"), ("--name", "truncated", "--sampling", "rollout")):
        result = probe("rescore", run, "--dtype", "fp32", *args)
        assert result.exit_code == 0, result.output
    plain = json.loads((run / "scores" / "plain" / "manifest.json").read_text())
    assert plain["sampling"] == {"temperature": 0.9, "top_p": 1.0, "top_k": 0, "logprobs_mode": "raw"}
    assert plain["n_outside_support"] is None
    assert KEPT_LOGMASS not in pq.read_schema(next((run / "scores" / "plain").glob("*.parquet"))).names
    side = json.loads((run / "scores" / "truncated" / "manifest.json").read_text())
    assert side["sampling"] == {"temperature": 0.9, "top_p": top_p, "top_k": 0, "logprobs_mode": "processed"}
    scores = table(run / "scores" / "truncated").filter(pl.col("is_response"))
    outside = 0
    for sample in table(run / "rollout").partition_by("sample_id", maintain_order=True):
        ids = sample["token_id"].to_numpy()
        logits = forward_logits(ids) / 0.9
        mine = scores.filter(pl.col("sample_id") == sample["sample_id"][0])
        for row in mine.iter_rows(named=True):
            scaled = logits[row["position"] - 1]
            keep = support_numpy(scaled, top_p, 0)
            assert row[KEPT_LOGMASS] == pytest.approx(log_mass(scaled, keep), abs=1e-4)
            if keep[row["token_id"]]:
                s = scaled.astype(np.float64)
                raw_lp = s[row["token_id"]] - np.log(np.exp(s - s.max()).sum()) - s.max()
                assert row["logprob"] == pytest.approx(raw_lp - log_mass(scaled, keep), abs=1e-4)
            else:
                assert row["logprob"] is None  # null, never -inf
                outside += 1
    assert outside > 0 and side["n_outside_support"] == outside


def test_processed_is_refused_where_the_engine_cannot_produce_it(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    result = probe(
        "generate", "--model", DEMO_MOE, "--prompts", prompts, "--out", tmp_path / "run", "--engine", "sglang",
        "--logprobs-mode", "processed",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--logprobs-mode processed: the sglang engine produces only raw" in result.output
    assert not (tmp_path / "run").exists()
    result = probe(
        "generate", "--model", DEMO_MOE, "--prompts", prompts, "--out", tmp_path / "r2", "--logprobs-mode", "x"
    )
    assert result.exit_code == 2 and "--logprobs-mode x: expected one of raw, processed" in result.output
