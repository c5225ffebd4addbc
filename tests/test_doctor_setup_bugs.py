"""probe doctor, third round (issue 40): truncated sampling, quantized modules and the prefill-to-decode
boundary, each planted in a tiny real run of the demo MoE model (a --top-p rollout, fake-quantized hf sides,
first response tokens perturbed in the Parquet); each names its own check and no other, and the known
settings (a rollout that records processed log-probs, a plain pass against a quantized rollout) stay clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import DEMO_MOE
from test_doctor import edit, edit_manifest, probe

from mismatch_probe.doctor.checks.check_list import CHECK_NAMES
from mismatch_probe.doctor.rules.setup_checks import ROUTER_NAMES
from mismatch_probe.doctor.run import run_checks
from mismatch_probe.schema import KEPT_LOGMASS

FP32 = ("--dtype", "fp32")


def prompts_file(root: Path, n: int) -> Path:
    path = root / "p.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": [3 + i, 40 + i, 7 * i + 1]}) for i in range(n)) + "\n")
    return path


def generate(run: Path, *args) -> None:
    result = probe("generate", "--model", DEMO_MOE, "--prompts", prompts_file(run.parent, 32), "--out", run,
                   "--max-new-tokens", 12, "--seed", 5, "--batch-size", 32, *FP32, *args)  # fmt: skip
    assert result.exit_code == 0, result.output


def rescore(run: Path, name: str, *args) -> None:
    result = probe("rescore", run, *FP32, "--name", name, *args)
    assert result.exit_code == 0, result.output


def findings(run: Path) -> dict:
    found = run_checks(run)
    for f in found:
        assert json.loads(json.dumps(f.to_json())) == f.to_json()  # plain JSON evidence
    return {f.check: f for f in found}


@pytest.fixture(scope="module")
def truncated_run(tmp_path_factory) -> Path:
    """A --top-p 0.7 rollout with processed log-probs (as the manifest records), rescored over the full
    vocabulary."""
    run = tmp_path_factory.mktemp("truncated") / "run"
    generate(run, "--top-p", 0.7, "--temperature", 0.9, "--logprobs-mode", "processed")
    rescore(run, "plain")
    return run


@pytest.fixture
def copy(truncated_run, tmp_path) -> Path:
    return Path(shutil.copytree(truncated_run, tmp_path / "run"))


def test_catalogue_names_the_new_checks():
    for name in ("truncated_logprobs", "quantized_router", "quant_modules_differ", "first_token_spike"):
        assert name in CHECK_NAMES
    assert len(CHECK_NAMES) == 22


def test_router_names_follow_the_quantizers_default_skip():
    from mismatch_probe.quant.targets import DEFAULT_SKIP

    assert set(ROUTER_NAMES) == set(DEFAULT_SKIP)


def test_a_recorded_processed_rollout_is_no_finding(truncated_run):
    assert findings(truncated_run) == {}  # a known setting: no truncation, no temperature finding


def naive_shift(run: Path) -> tuple[float, float, float]:
    """Mean rollout - plain log-prob over response tokens, the share at or above, and mean kept_logmass."""
    roll = pl.read_parquet(run / "rollout" / "*.parquet").filter(pl.col("is_response"))
    plain = pl.read_parquet(run / "scores" / "plain" / "*.parquet").filter(pl.col("is_response"))
    both = roll.join(plain, on=["sample_id", "position"], suffix="_p").drop_nulls(["logprob", "logprob_p"])
    d = (both["logprob"].cast(pl.Float64) - both["logprob_p"].cast(pl.Float64)).to_numpy()
    return float(d.mean()), float((d >= 0).mean()), float(roll[KEPT_LOGMASS].cast(pl.Float64).mean())


@pytest.mark.parametrize("mode", ["raw", None])
def test_an_unrecorded_truncation_is_truncated_logprobs(copy, mode):
    """The manifest says raw (or, an imported dump, nothing): the one-sided gap is named as truncation, never
    as a temperature, and its size is minus the mean log kept mass."""

    def change(m):
        if mode is None:
            m["sampling"] = None
        else:
            m["sampling"]["logprobs_mode"] = mode

    edit_manifest(copy / "manifest.json", change)
    found = findings(copy)
    assert list(found) == ["truncated_logprobs"], [f.found for f in found.values()]
    e = found["truncated_logprobs"].evidence
    shift, above, kept = naive_shift(copy)
    assert e["mean_rollout_minus_other"] == pytest.approx(shift, rel=1e-6)
    assert e["share_rollout_at_or_above"] == pytest.approx(above) and above > 0.95
    assert e["mean_kept_logmass"] == pytest.approx(kept, rel=1e-5) and shift == pytest.approx(-kept, rel=0.05)
    assert e["side"] == "rollout" and e["logprobs_mode"] == mode
    assert "probe rescore RUN --sampling rollout" in found["truncated_logprobs"].fix["probe"]


def test_a_training_side_over_the_same_support_is_clean(copy):
    edit_manifest(copy / "manifest.json", lambda m: m["sampling"].update(logprobs_mode="raw"))
    rescore(copy, "truncated", "--sampling", "rollout")
    found = run_checks(copy, pairs=[("rollout", "scores/truncated")])
    assert found == [], [f.found for f in found]


def test_a_kept_mass_that_does_not_explain_the_gap_is_not_truncation(copy):
    """The shift is planted on a raw rollout whose kept_logmass says nothing was cut: not a truncation."""
    edit_manifest(copy / "manifest.json", lambda m: m["sampling"].update(logprobs_mode="raw"))
    edit(copy, "rollout", lambda f: f.with_columns(pl.col(KEPT_LOGMASS) * 0.2))
    assert "truncated_logprobs" not in findings(copy)


def test_the_first_token_spike(copy):
    """Position 0 of each response lowered by 0.5 nats, the rest untouched, against a side scored over the
    rollout's own support (both processed: no truncation gap)."""
    rescore(copy, "same", "--sampling", "rollout")
    first = pl.col("position") == pl.col("position").filter(pl.col("is_response")).min().over("sample_id")
    perturb = pl.when(first).then(pl.col("logprob") - 0.5).otherwise(pl.col("logprob")).alias("logprob")
    edit(copy, "rollout", lambda f: f.with_columns(perturb))
    found = run_checks(copy, pairs=[("rollout", "scores/same")])
    assert [f.check for f in found] == ["first_token_spike"], [f.found for f in found]
    e = found[0].evidence
    roll = pl.read_parquet(copy / "rollout" / "*.parquet").filter(pl.col("is_response")).sort("sample_id", "position")
    same = pl.read_parquet(copy / "scores/same" / "*.parquet").filter(pl.col("is_response"))
    both = roll.join(same, on=["sample_id", "position"], suffix="_s").drop_nulls(["logprob", "logprob_s"])
    both = both.with_columns(d=(pl.col("logprob").cast(pl.Float64) - pl.col("logprob_s").cast(pl.Float64)).abs())
    is_first = both["position"] == both.select(pl.col("position").min().over("sample_id"))["position"]
    d = both["d"].to_numpy()
    mask = is_first.to_numpy()
    assert e["first"]["n_tokens"] == mask.sum() == 32
    assert e["first"]["mean_abs_delta"] == pytest.approx(d[mask].mean(), rel=1e-6)
    assert e["rest"]["mean_abs_delta"] == pytest.approx(d[~mask].mean(), rel=1e-4, abs=1e-9)
    assert e["first"]["ci95"][0] > 2.5 * e["rest"]["ci95"][1]


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory) -> Path:
    """An fp8 rollout with its routers and lm_head quantized (weight_quant_skip= empty), rescored plain, with
    the default skip list, and with o_proj skipped too."""
    run = tmp_path_factory.mktemp("quant") / "run"
    generate(run, "--engine-arg", "weight_quant=fp8-block128", "--engine-arg", "weight_quant_skip=")
    rescore(run, "plain")
    rescore(run, "fp8", "--engine-arg", "weight_quant=fp8-block128")
    rescore(run, "fp8-noattn", "--engine-arg", "weight_quant=fp8-block128",
            "--engine-arg", "weight_quant_skip=mlp.gate.,lm_head,o_proj")  # fmt: skip
    return run


def test_a_plain_pass_against_a_quantized_rollout_is_no_finding(quant_run):
    assert run_checks(quant_run, pairs=[("scores/fp8", "scores/plain")]) == []


def test_quantized_routers_on_one_side(quant_run):
    found = run_checks(quant_run, pairs=[("rollout", "scores/plain")])
    assert [f.check for f in found] == ["quantized_router"], [f.found for f in found]
    manifest = json.loads((quant_run / "manifest.json").read_text())
    routers = sorted(m for m in manifest["quantization"]["quantized_modules"] if "mlp.gate." in m or "lm_head" in m)
    assert routers and found[0].evidence["modules"] == routers and found[0].evidence["side"] == "rollout"


def test_quantized_modules_differ(quant_run):
    found = run_checks(quant_run, pairs=[("scores/fp8", "scores/fp8-noattn")])
    assert [f.check for f in found] == ["quant_modules_differ"], [f.found for f in found]
    a = set(json.loads((quant_run / "scores/fp8/manifest.json").read_text())["quantization"]["quantized_modules"])
    b = set(
        json.loads((quant_run / "scores/fp8-noattn/manifest.json").read_text())["quantization"]["quantized_modules"]
    )
    e = found[0].evidence
    assert e["only_reference"] == sorted(a - b) and e["only_candidate"] == sorted(b - a) == []
    assert all("o_proj" in m for m in e["only_reference"]) and e["only_reference"]
    # rollout (routers quantized) against fp8 (default skip): both fire, each once
    both = run_checks(quant_run, pairs=[("rollout", "scores/fp8")])
    assert sorted(f.check for f in both) == ["quant_modules_differ", "quantized_router"]


def test_a_side_that_names_its_scheme_but_not_its_modules_is_not_compared(quant_run, tmp_path):
    """An SGLang or vLLM side records {weight: fp8, quantized_modules: null}: which modules it reaches is
    unknown, so neither check speaks of it (before, an unknown list counted as none quantized)."""
    run = Path(shutil.copytree(quant_run, tmp_path / "run"))
    server = {"weight": "fp8", "act": None, "kv": None, "quantized_modules": None, "skipped_modules": None}
    edit_manifest(run / "scores" / "plain" / "manifest.json", lambda m: m.update(quantization=server))
    assert run_checks(run, pairs=[("rollout", "scores/plain")]) == []
    assert [f.check for f in run_checks(quant_run, pairs=[("rollout", "scores/plain")])] == ["quantized_router"]


def test_first_tokens_merge_exactly():
    from mismatch_probe.doctor.stats.first_token import FirstTokens

    class Rows:
        def __init__(self, sample, position):
            self.sample_id, self.position = np.array(sample), np.array(position)

    class Frame:
        def __init__(self, sample, position, a):
            self.rows, self.compared, self.abs_delta = Rows(sample, position), np.arange(len(a)), np.array(a)

    whole, a, b = FirstTokens(), FirstTokens(), FirstTokens()
    whole.update(Frame([1, 1, 1, 2, 2], [3, 4, 5, 2, 3], [0.9, 0.1, 0.2, 0.8, 0.3]))
    b.update(Frame([1, 2, 2], [5, 2, 3], [0.2, 0.8, 0.3]))
    a.update(Frame([1, 1], [3, 4], [0.9, 0.1]))
    b.merge(a)
    assert whole.first == b.first == {1: (3, 0.9), 2: (2, 0.8)}
    assert np.allclose(whole.totals, b.totals)
