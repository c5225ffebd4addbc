"""probe doctor: each check against its fault, planted in a tiny real run (the demo MoE model, sampled at
T = 2, rescored by hf) by editing the Parquet or manifest the way the real bug writes it; the clean run
and the demo stay clean. Exit codes 0 healthy, 1 findings, 2 bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from conftest import DEMO_MOE, DEMO_PROMPTS
from frames import with_empty_null_lists
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.doctor.run import run_checks

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
BASE = "scores/hf-bf16-pass1"


def probe(*args):
    return runner.invoke(app, [str(a) for a in args])


def edit(run: Path, side: str, change) -> None:
    """Rewrite a side's parts through `change(DataFrame) -> DataFrame`, keeping the schema."""
    for part in sorted((run / side).glob("part-*.parquet")):
        table = pq.read_table(part)
        changed = change(pl.from_arrow(table)).to_arrow().cast(table.schema)
        pq.write_table(with_empty_null_lists(changed), part)


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def in_response(column: str, shift: int) -> pl.Expr:
    """The column moved `shift` rows within each sample's response (the bug's off-by-one)."""
    moved = pl.col(column).shift(shift).over("sample_id")
    return pl.when(pl.col("is_response")).then(moved).otherwise(pl.col(column)).alias(column)


def sampled_and_rescored(run: Path, max_new_tokens: int, num_prompts: int = 16) -> Path:
    """2 samples of each of the first 16 (or `num_prompts`) prompts of the demo MoE model at T = 2 (bf16),
    rescored by hf bf16 twice."""
    out = probe(
        "generate", "--model", DEMO_MOE, "--prompts", DEMO_PROMPTS, "--out", run, "--num-prompts", num_prompts,
        "--samples-per-prompt", 2, "--temperature", 2, "--max-new-tokens", max_new_tokens, "--dtype", "bf16",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert probe("rescore", run, "--dtype", "bf16", "--repeats", 2).exit_code == 0
    return run


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """32 samples of the demo MoE model at T = 2 (bf16), rescored by hf bf16 twice; plus `t1`, the same
    rescoring at T = 1 (the manifest's scoring temperature edited for it, then restored)."""
    run = sampled_and_rescored(tmp_path_factory.mktemp("doctor") / "run", max_new_tokens=16)
    original = (run / "manifest.json").read_text()
    edit_manifest(run / "manifest.json", lambda m: m.update(scoring_temperature=1.0))
    assert probe("rescore", run, "--dtype", "bf16", "--name", "t1").exit_code == 0
    (run / "manifest.json").write_text(original)
    edit_manifest(run / "scores/t1/manifest.json", lambda m: m.update(temperature=2.0))
    return run


@pytest.fixture
def run(clean_run, tmp_path) -> Path:
    """A copy without the T = 1 score set (kept aside in `run.t1`)."""
    copy = Path(shutil.copytree(clean_run, tmp_path / "run"))
    shutil.move(copy / "scores/t1", tmp_path / "t1")
    return copy


def checks(run: Path) -> list[str]:
    return [f.check for f in run_checks(run)]


def only(run: Path, name: str):
    findings = run_checks(run)
    assert [f.check for f in findings] == [name], [f.found for f in findings]
    return findings[0]


def test_clean_run_is_healthy(run):
    assert checks(run) == []
    result = probe("doctor", run)
    assert result.exit_code == 0, result.output
    assert "healthy" in result.output
    out = probe("doctor", run, "--json")
    assert out.exit_code == 0 and json.loads(out.output) == {"healthy": True, "findings": []}


def test_processed_logprobs_rollout_at_another_temperature(run, tmp_path):
    """The inference engine returned log-probs at T = 1 (raw logits) while sampling at T = 2."""
    raw = pl.read_parquet(tmp_path / "t1" / "*.parquet").select("sample_id", "position", "logprob", "top_logprob")
    keys = ["sample_id", "position"]
    edit(run, "rollout", lambda d: d.drop("logprob", "top_logprob").join(raw, on=keys, how="left").select(d.columns))
    finding = only(run, "processed_logprobs")
    assert finding.evidence["side"] == "rollout"
    assert finding.evidence["gap_ratio"] == pytest.approx(2.0, rel=0.05)
    assert finding.evidence["fitted_temperature"] == pytest.approx(1.0, rel=0.05)
    assert set(finding.fix) == {"probe", "verl", "slime", "nemo_rl"}
    result = probe("doctor", run, "--json")
    assert result.exit_code == 1
    assert [f["check"] for f in json.loads(result.output)["findings"]] == ["processed_logprobs"]


def test_temperature_mismatch_training_side(run, tmp_path):
    """The training side scored at T = 1 against a rollout sampled at T = 2."""
    shutil.rmtree(run / "scores")
    (run / "scores").mkdir()
    shutil.copytree(tmp_path / "t1", run / "scores/t1")
    finding = only(run, "temperature_mismatch")
    assert finding.evidence["side"] == "scores/t1"
    assert finding.evidence["gap_ratio"] == pytest.approx(0.5, rel=0.05)
    assert finding.evidence["fitted_temperature"] == pytest.approx(1.0, rel=0.05)


def test_temperature_mismatch_recorded_in_the_manifest(run, tmp_path):
    """A score set whose manifest says it scored at T = 1: report refuses the run (exit 2), the doctor
    names it and still checks the rest."""
    shutil.copytree(tmp_path / "t1", run / "scores/t1")
    edit_manifest(run / "scores/t1/manifest.json", lambda m: m.update(temperature=1.0))
    assert probe("report", run).exit_code == 2
    findings = run_checks(run)
    assert [f.check for f in findings] == ["temperature_mismatch"]
    assert findings[0].evidence == {"side": "scores/t1", "recorded_temperature": 1.0, "scoring_temperature": 2.0}


@pytest.mark.parametrize("side", ["rollout", BASE])
@pytest.mark.parametrize("shift", [1, -1])
def test_off_by_one(run, side, shift):
    """One side's log-probs stored one row late or early within each response; the side is named
    because it is the one side of every comparison that shows the shift."""
    edit(run, side, lambda d: d.with_columns(in_response("logprob", shift)))
    finding = only(run, "off_by_one")
    assert finding.evidence["side"] == side
    assert finding.evidence["mean_abs_delta"] > 0.3
    shifted = min(
        finding.evidence["mean_abs_delta_candidate_later"], finding.evidence["mean_abs_delta_candidate_earlier"]
    )
    assert shifted < 0.02


def test_token_ids_differ(run):
    """The training side scored a re-tokenised response: other ids at sample 3 from position 5."""
    change = (pl.col("sample_id") == 3) & (pl.col("position") >= 5)
    edit(run, BASE, lambda d: d.with_columns(token_id=pl.when(change).then(7).otherwise(pl.col("token_id"))))
    finding = only(run, "token_ids_differ")
    assert finding.evidence["first_sample"] == 3 and finding.evidence["first_position"] == 5
    assert finding.evidence["samples_differing"] == 1
    assert finding.evidence["ids_candidate"][0] == 7
    result = probe("doctor", run)
    assert result.exit_code == 1
    assert "token_ids_differ" in result.output and "fix (verl)" in result.output
    assert "1 finding(s): token_ids_differ" in result.output


def test_token_ids_differ_retokenised_lengths_and_prompt(run):
    """Re-encoded text: sample 5's response is one token shorter, and sample 9's prompt has other ids."""

    def retokenise(d: pl.DataFrame) -> pl.DataFrame:
        last = pl.col("position") == pl.col("position").max().over("sample_id")
        d = d.filter(~((pl.col("sample_id") == 5) & last))
        prompt = (pl.col("sample_id") == 9) & (pl.col("position") == 1)
        return d.with_columns(token_id=pl.when(prompt).then(11).otherwise(pl.col("token_id")))

    edit(run, BASE, retokenise)
    finding = only(run, "token_ids_differ")
    assert finding.evidence["samples_differing"] == 2
    assert (finding.evidence["first_sample"], finding.evidence["first_in"]) == (5, "response")
    assert finding.evidence["ids_candidate"] == []  # the candidate ends where the reference goes on


def test_weights_differ_by_k3_with_routing_alike(run):
    """Other weights on the training side, same dtype, same routes: log-probs far apart everywhere."""
    offset = 0.5 * (((pl.col("position") * 7919 + pl.col("sample_id") * 104729) % 2) * 2 - 1)
    moved = {name: pl.min_horizontal(pl.col(name) + offset, 0.0) for name in ("logprob", "top_logprob")}
    edit(run, BASE, lambda d: d.with_columns(**moved))
    finding = only(run, "weights_differ")
    assert finding.evidence["k3_kl_routing_same"] > 0.01


@pytest.mark.parametrize("side", ["rollout", BASE])
@pytest.mark.parametrize("shift", [1, -1])
def test_replay_misaligned_routes_one_position_off(run, side, shift):
    """Routes stored (rollout) or replayed (training side) one position late or early."""
    edit(run, side, lambda d: d.with_columns(pl.col("experts").shift(shift).over("sample_id")))
    finding = only(run, "replay_misaligned")
    if "route_match_same_position" in finding.evidence:
        assert finding.evidence["route_match_same_position"] < 0.5
        late, early = finding.evidence["route_match_candidate_later"], finding.evidence["route_match_candidate_earlier"]
        assert max(late, early) > 0.9
    else:
        assert finding.evidence["shifted_samples"] == finding.evidence["n_samples"] == 32


def test_routing_rows_lost_on_a_cached_prefix(run):
    """A prefix-cache hit served positions 0-2 of samples 1, 3 and 5 with no routing rows."""
    lost = pl.col("sample_id").is_in([1, 3, 5]) & (pl.col("position") < 3)
    edit(run, "rollout", lambda d: d.with_columns(experts=pl.when(lost).then(None).otherwise(pl.col("experts"))))
    finding = only(run, "routing_rows_lost")
    assert finding.evidence["lost_rows"] == 9 and finding.evidence["lost_samples"] == 3
    assert (finding.evidence["first_sample"], finding.evidence["first_position"]) == (1, 0)


def test_greedy(run):
    def greedy(m):
        m["sampling"]["temperature"] = 0.0

    edit_manifest(run / "manifest.json", greedy)
    assert "greedy" in checks(run)


def test_empty_responses(run):
    """Most responses hold only the end token (id 1 is not special here: the config's eos is used)."""
    eos = json.loads((DEMO_MOE / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos

    def empty(d: pl.DataFrame) -> pl.DataFrame:
        first = pl.col("position") == pl.col("position").filter(pl.col("is_response")).min().over("sample_id")
        keep = ~pl.col("is_response") | first | (pl.col("sample_id") % 4 == 0)
        return d.filter(keep).with_columns(
            token_id=pl.when(first & (pl.col("sample_id") % 4 != 0)).then(eos).otherwise(pl.col("token_id"))
        )

    for side in ("rollout", BASE, "scores/hf-bf16-pass2"):
        edit(run, side, empty)
    finding = only(run, "empty_responses")
    assert finding.evidence["n_empty"] == 24 and finding.evidence["n_samples"] == 32


def _end_token_inside(samples: set[int], end: int):
    """Each of `samples` gets `end` as its second response token, the rest of its response kept after it."""

    def plant(d: pl.DataFrame) -> pl.DataFrame:
        second = pl.col("position") == pl.col("position").filter(pl.col("is_response")).min().over("sample_id") + 1
        target = second & pl.col("sample_id").is_in(sorted(samples))
        return d.with_columns(token_id=pl.when(target).then(end).otherwise(pl.col("token_id")))

    return plant


def test_past_end_token_names_the_samples(run):
    """A response that goes on after an end id the manifest lists (an FP8 load that lost generation_config.json's
    ids) is flagged, naming its samples; the same id where the manifest lists none stays clean."""
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["eos_token_ids"]  # the ids the rollout recorded
    end = 77  # no end id of the demo model: the rollout lists it only once edited in
    lengths = pl.read_parquet(run / "rollout").group_by("sample_id").agg(pl.col("is_response").sum())
    planted = sorted(lengths.filter(pl.col("is_response") >= 3)["sample_id"].to_list())[1::4][:3]
    for side in ("rollout", BASE, "scores/hf-bf16-pass2"):
        edit(run, side, _end_token_inside(set(planted), end))
    assert checks(run) == []
    edit_manifest(run / "manifest.json", lambda m: m.update(eos_token_ids=[*m["eos_token_ids"], end]))
    finding = only(run, "past_end_token")
    assert finding.evidence["n_past_eos"] == 3 and finding.evidence["past_eos_samples"] == planted
    named = ", ".join(map(str, planted))
    assert "3 of 32 responses go on after an end token" in finding.found and f"samples {named}" in finding.found
    result = probe("doctor", run)
    assert result.exit_code == 1 and "past_end_token" in result.output


def test_past_end_token_in_a_run_that_records_no_end_ids(run):
    """An imported dump's manifest lists no end ids: the checkpoint's config files give them."""
    eos = json.loads((DEMO_MOE / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    edit_manifest(run / "manifest.json", lambda m: m.pop("eos_token_ids"))
    lengths = pl.read_parquet(run / "rollout").group_by("sample_id").agg(pl.col("is_response").sum())
    sample = min(lengths.filter(pl.col("is_response") >= 3)["sample_id"].to_list())
    for side in ("rollout", BASE, "scores/hf-bf16-pass2"):
        edit(run, side, _end_token_inside({sample}, eos))
    finding = only(run, "past_end_token")
    assert finding.evidence["past_eos_samples"] == [sample] and eos in finding.evidence["eos_ids"]


def test_too_few_tokens(run):
    for side in ("rollout", BASE, "scores/hf-bf16-pass2"):
        edit(run, side, lambda d: d.filter(pl.col("sample_id") == 0))
    found = checks(run)
    assert set(found) == {"too_few_tokens"} and len(found) == 3


def test_bad_input_exits_2(tmp_path):
    result = probe("doctor", tmp_path / "missing")
    assert result.exit_code == 2
    assert "run directory not found" in result.output


def test_report_writes_findings_and_gate_refuses_unless_allowed(run):
    shift = pl.col("experts").shift(1).over("sample_id")
    edit(run, "rollout", lambda d: d.with_columns(experts=shift))
    report = probe("report", run)
    assert report.exit_code == 0, report.output
    assert "doctor: replay_misaligned" in report.output
    metrics = json.loads((run / "report/metrics.json").read_text())
    assert [f["check"] for f in metrics["findings"]] == ["replay_misaligned"]
    assert set(metrics["findings"][0]) == {"check", "found", "cause", "fix", "evidence"}
    assert "probe doctor" in (run / "report/index.html").read_text()
    refused = probe("gate", run, "--max", "k3_kl=10")
    assert refused.exit_code == 1, refused.output
    assert "doctor finding replay_misaligned: REFUSED" in refused.output
    junit = run.parent / "gate.xml"
    assert probe("gate", run, "--max", "k3_kl=10", "--junit", junit).exit_code == 1
    assert '<testcase classname="doctor" name="replay_misaligned"><failure' in junit.read_text()
    allowed = probe("gate", run, "--max", "k3_kl=10", "--allow", "replay_misaligned", "--json")
    assert allowed.exit_code == 0, allowed.output
    document = json.loads(allowed.output)
    assert document["passed"] and document["findings"][0]["allowed"]
    assert probe("gate", run, "--max", "k3_kl=10", "--allow", "nonsense").exit_code == 2


def test_clean_report_has_no_findings_and_gate_passes(run):
    assert probe("report", run).exit_code == 0
    assert json.loads((run / "report/metrics.json").read_text())["findings"] == []
    assert probe("gate", run, "--max", "k3_kl=10").exit_code == 0


def test_weights_differ_by_fingerprint(run, tmp_path):
    """The training side loaded a checkpoint one update step away (same config): fingerprints differ."""
    import torch
    from safetensors.torch import load_file, save_file

    stale = Path(shutil.copytree(DEMO_MOE, tmp_path / "stale"))
    weights = load_file(stale / "model.safetensors")
    torch.manual_seed(0)
    save_file({k: v + 1e-3 * torch.randn_like(v) for k, v in weights.items()}, stale / "model.safetensors")
    assert probe("rescore", run, "--model", stale, "--dtype", "bf16", "--name", "stale").exit_code == 0
    manifests = [json.loads((run / p).read_text())["engine"] for p in ("manifest.json", f"{BASE}/manifest.json")]
    assert manifests[0]["weights_fingerprint"] == manifests[1]["weights_fingerprint"] is not None
    finding = only(run, "weights_differ")
    assert finding.evidence["fingerprint_reference"]["sha256"] != finding.evidence["fingerprint_candidate"]["sha256"]
    assert "scores/stale" in finding.found


def test_truncated_logprobs_renormalised_over_top_k(run):
    """The inference engine sampled with top_k = 40 and returned log-probs renormalised over those 40
    tokens: each position's log-probs move up by -log(mass of its top 40), computed here from the model. The
    manifest records top_k 40 and raw log-probs: truncated_logprobs (issue 40), not a temperature."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MOE, dtype=torch.float32).eval()
    rollout = pl.read_parquet(run / "rollout" / "*.parquet")
    lift = []
    with torch.no_grad():
        for sample in rollout.partition_by("sample_id", maintain_order=True):
            ids = torch.tensor(sample["token_id"].to_list())[None]
            logits = model(input_ids=ids).logits[0, :-1] / 2.0  # position p+1's distribution, at T = 2
            mass = torch.softmax(logits, -1).topk(40, dim=-1).values.sum(-1)
            lift += [0.0] + (-torch.log(mass)).tolist()
    lifted = rollout.with_columns(lift=pl.Series(lift)).select("sample_id", "position", "lift")

    def renormalise(d: pl.DataFrame) -> pl.DataFrame:
        d = d.join(lifted, on=["sample_id", "position"], how="left")
        up = {name: pl.min_horizontal(pl.col(name) + pl.col("lift"), 0.0) for name in ("logprob", "top_logprob")}
        return d.with_columns(**up).drop("lift")

    edit(run, "rollout", renormalise)
    edit_manifest(run / "manifest.json", lambda m: m["sampling"].update(top_k=40))
    finding = only(run, "truncated_logprobs")
    assert finding.evidence["top_k"] == 40 and finding.evidence["logprobs_mode"] == "raw"
    assert 0.3 < finding.evidence["support_mass"] < 0.99
    assert finding.evidence["mean_rollout_minus_other"] > 0.01


@pytest.mark.parametrize(
    ("ratio", "calibration", "expected"),
    [
        (2.0, {"ref": {"z": 12.0}, "cand": {"z": 0.5}}, "ref"),  # rollout miscalibrated
        (2.0, {"ref": {"z": 0.5}, "cand": {"z": -9.0}}, "cand"),  # training side miscalibrated
        (2.0, {"ref": None, "cand": None}, "ref"),  # flat model: rollout at T = 1 against recorded T = 2
        (0.5, {"ref": {"z": 1.0}, "cand": {"z": 1.5}}, "cand"),  # training side at T = 1
        (1.5, {"ref": None, "cand": None}, "cand"),  # nothing decides: the training side
    ],
)
def test_temperature_culprit(ratio, calibration, expected):
    from mismatch_probe.doctor.stats.temperature import culprit

    assert culprit(calibration, ratio, recorded=2.0) == expected


def test_megatron_records_the_same_fingerprint(run):
    """megatron maps the HF weights in (padded vocabulary, fp32): its fingerprint is the rollout's."""
    pytest.importorskip("megatron.core")
    result = probe("rescore", run, "--engine", "megatron", "--dtype", "fp32", "--name", "mg")
    assert result.exit_code == 0, result.output
    rollout, megatron = (
        json.loads((run / p).read_text())["engine"] for p in ("manifest.json", "scores/mg/manifest.json")
    )
    assert megatron["weights_fingerprint"] == rollout["weights_fingerprint"] is not None
    assert checks(run) == []
