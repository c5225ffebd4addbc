"""probe doctor, second round: each engine or transport bug planted in a tiny real run (the demo MoE model,
4 MoE layers of 16 experts, top-2, sampled at T = 2, rescored by hf twice) by editing the Parquet the way
the real bug writes it; each names its own check and no other, and the clean run stays clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from test_doctor import BASE, checks, edit, probe, sampled_and_rescored

from mismatch_probe.doctor.run import run_checks
from mismatch_probe.rundir.layout import Run
from mismatch_probe.schema import experts_matrix, routing_list

PASS2 = "scores/hf-bf16-pass2"
SIDES = ("rollout", BASE, PASS2)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """64 samples (32 prompts x 2) of the demo MoE model at T = 2, up to 48 new tokens, rescored twice: enough
    response tokens before position 8 for position_onset's floor of tokens before P."""
    return sampled_and_rescored(tmp_path_factory.mktemp("doctor2") / "run", max_new_tokens=48, num_prompts=32)


@pytest.fixture
def run(clean_run, tmp_path) -> Path:
    return Path(shutil.copytree(clean_run, tmp_path / "run"))


def only(run: Path, name: str):
    findings = run_checks(run)
    assert [f.check for f in findings] == [name], [f.found for f in findings]
    assert json.loads(json.dumps(findings[0].to_json())) == findings[0].to_json()  # plain JSON evidence
    return findings[0]


def edit_experts(run: Path, side: str, change) -> None:
    """Rewrite a side's routes through `change(ids [n, layers, k], routed [n], table) -> ids` (a copy)."""
    shape = Run(run).manifest().routing
    for part in sorted((run / side).glob("part-*.parquet")):
        table = pq.read_table(part)
        ids, routed = experts_matrix(table.column("experts"), shape)
        ids = change(ids.copy(), routed, table)
        i = table.schema.get_field_index("experts")
        field = table.schema.field(i)
        column = routing_list(ids.reshape(len(ids), -1), shape.width, routed, field.type.value_type)
        pq.write_table(table.set_column(i, field, column), part)


def test_clean_run_is_healthy(run):
    assert checks(run) == []


# ---- routes -----------------------------------------------------------------------------------------------


def test_routes_constant_all_zeros_in_one_layer(run):
    """vLLM#54730: a monolithic kernel bypassed routing capture in MoE layer 0 of the rollout: expert 0 for
    every token. Named by routes_constant alone (not as an outlier, nor as repeated ids)."""

    def zeros(ids, routed, table):
        ids[:, 0, :] = 0
        return ids

    edit_experts(run, "rollout", zeros)
    finding = only(run, "routes_constant")
    assert finding.evidence["side"] == "rollout"
    assert finding.evidence["layers"] == [0] and finding.evidence["all_zero_layers"] == [0]
    assert finding.evidence["top_set_share"] == [1.0]


def test_routes_constant_same_set_on_the_training_side(run):
    """A pipeline stage's layer filled with one fixed expert set on a training pass: the other pass varies."""

    def fixed(ids, routed, table):
        ids[:, 2, :] = [3, 11]
        return ids

    edit_experts(run, BASE, fixed)
    finding = only(run, "routes_constant")
    assert finding.evidence["side"] == BASE and finding.evidence["layers"] == [2]
    assert finding.evidence["all_zero_layers"] == []


def test_routes_invalid_out_of_range_ids(run):
    """Unmapped EPLB replicas: every third routed row of layer 1 holds a physical id >= the 16 experts. The
    report refuses the run (exit 2) and points to the doctor, which names the engine bug."""
    experts = Run(run).manifest().num_experts

    def replicas(ids, routed, table):
        rows = np.flatnonzero(routed)[::3]
        ids[rows, 1, 0] = experts + rows % 4
        return ids

    edit_experts(run, "rollout", replicas)
    report = probe("report", run)
    assert report.exit_code == 2
    assert "probe doctor" in report.output and "routes_invalid" in report.output
    finding = only(run, "routes_invalid")
    assert finding.evidence["kinds"] == ["out_of_range"]
    routed = [int(experts_matrix(t.column("experts"), Run(run).manifest().routing)[1].sum())
              for t in (pq.read_table(p) for p in sorted((run / "rollout").glob("part-*.parquet")))]  # fmt: skip
    assert finding.evidence["out_of_range_rows"] == {"1": sum(len(range(0, n, 3)) for n in routed)}  # per part
    assert finding.evidence["first_out_of_range"][3] >= experts
    result = probe("doctor", run, "--json")
    assert result.exit_code == 1 and [f["check"] for f in json.loads(result.output)["findings"]] == ["routes_invalid"]


def test_routes_invalid_repeated_id_in_a_token_s_top_k(run):
    """Every second routed row of layer 3 lists its first expert twice."""
    rows_changed = []

    def repeat(ids, routed, table):
        rows = np.flatnonzero(routed)[::2]
        ids[rows, 3, 1] = ids[rows, 3, 0]
        rows_changed.append(len(rows))
        return ids

    edit_experts(run, "rollout", repeat)
    finding = only(run, "routes_invalid")
    assert finding.evidence["kinds"] == ["repeated_id"]
    assert finding.evidence["repeated_id_rows"] == {"3": sum(rows_changed)}  # every row is checked on a tiny run


def test_layer_routes_outlier_draft_routes_in_layer_0(run):
    """vLLM PR #48622: an MTP/draft router's choices overwrote the rollout's first MoE layer (distinct
    experts, chosen by another router: here at random)."""
    rng = np.random.default_rng(0)

    def draft(ids, routed, table):
        ids[:, 0, :] = np.argsort(rng.random((len(ids), 16)), axis=1)[:, :2]
        return ids

    edit_experts(run, "rollout", draft)
    finding = only(run, "layer_routes_outlier")
    assert finding.evidence["layers"] == [0] and finding.evidence["draft_signature"]
    assert finding.evidence["side"] == "rollout"
    assert finding.evidence["rates"][0] > 0.5


# ---- log-probs --------------------------------------------------------------------------------------------


def _noise(d: pl.DataFrame) -> pl.Expr:
    """A deterministic positive step per row, mean 0.2 nats (the hash of sample and position)."""
    u = ((pl.col("sample_id") * 7919 + pl.col("position") * 104729) % 1000 + 0.5) / 1000
    return -0.2 * u.log()


@pytest.mark.parametrize("onset", [8, 16, 24])
def test_position_onset_fp8_kv_cache(run, onset):
    """The rollout's log-probs a step worse from position P on (an fp8 KV cache), as the fault writes them."""
    after = pl.col("is_response") & (pl.col("position") >= onset)
    edit(run, "rollout", lambda d: d.with_columns(logprob=pl.when(after).then(pl.col("logprob") - _noise(d))
                                                  .otherwise(pl.col("logprob"))))  # fmt: skip
    finding = only(run, "position_onset")
    assert finding.evidence["side"] == "rollout"
    assert abs(finding.evidence["onset_position"] - onset) <= 1
    assert finding.evidence["after"]["mean_abs_delta"] > 2.5 * finding.evidence["before"]["mean_abs_delta"]


def _response_index() -> pl.Expr:
    return pl.col("position") - pl.col("position").filter(pl.col("is_response")).min().over("sample_id")


def test_cumulative_logprobs_running_sums(run):
    """Streamed log-probs that were cumulative: the rollout holds running sums of the training side's."""
    training = pl.read_parquet(run / BASE / "*.parquet").select("sample_id", "position", pl.col("logprob").alias("t"))

    def running(d: pl.DataFrame) -> pl.DataFrame:
        d = d.join(training, on=["sample_id", "position"], how="left")
        summed = pl.col("t").fill_null(0.0).cum_sum().over("sample_id")
        return d.with_columns(logprob=pl.when(pl.col("is_response")).then(summed).otherwise(None)).drop("t")

    edit(run, "rollout", running)
    finding = only(run, "cumulative_logprobs")
    assert finding.evidence["side"] == "rollout" and finding.evidence["form"] == "running_sums"


@pytest.mark.parametrize("chunk", [4, 16, "varying"])
def test_cumulative_logprobs_chunk_totals_spread(run, chunk):
    """Each stream chunk's total spread evenly over its tokens (chunks of 4 or 16, or of 4-16 tokens)."""
    if chunk == "varying":
        block = (_response_index() // 4) * 4  # chunk starts at 0, 4, ...; pairs of chunks merged alternately
        block = pl.when((_response_index() // 4) % 3 == 1).then(block - 4).otherwise(block)
    else:
        block = _response_index() // chunk
    spread = pl.col("logprob").mean().over("sample_id", "chunk")

    def totals(d: pl.DataFrame) -> pl.DataFrame:
        d = d.with_columns(chunk=pl.when(pl.col("is_response")).then(block).otherwise(-1))
        return d.with_columns(logprob=pl.when(pl.col("is_response")).then(spread).otherwise(None)).drop("chunk")

    edit(run, "rollout", totals)
    finding = only(run, "cumulative_logprobs")
    assert finding.evidence["side"] == "rollout" and finding.evidence["form"] == "chunk_totals"
    assert finding.evidence["flat_token_share"] > 0.5


def test_duplicate_samples_cloned_within_each_prompt_group(run):
    """UniRL PR #208: both samples of each prompt drawn with one seed: sample 2i+1 is sample 2i's twin, on
    every side (the training side scores what the rollout holds)."""

    def clone(d: pl.DataFrame) -> pl.DataFrame:
        first = d.filter(pl.col("sample_id") % 2 == 0)
        twin = first.with_columns(sample_id=pl.col("sample_id") + 1)
        return pl.concat([first, twin]).sort("sample_id", "position")

    for side in SIDES:
        edit(run, side, clone)
    finding = only(run, "duplicate_samples")
    manifest = Run(run).manifest()
    assert (
        finding.evidence["twins"] == manifest.num_samples
        and finding.evidence["groups_with_twins"] == manifest.num_prompts
    )
    assert finding.evidence["expected"] < 1


def test_a_natural_twin_is_not_a_finding(run):
    """One group's two samples identical: too few to be a finding."""

    def clone(d: pl.DataFrame) -> pl.DataFrame:
        twin = d.filter(pl.col("sample_id") == 0).with_columns(sample_id=pl.lit(1, pl.UInt32))
        return pl.concat([d.filter(pl.col("sample_id") != 1), twin]).sort("sample_id", "position")

    for side in SIDES:
        edit(run, side, clone)
    assert checks(run) == []


# ---- report, gate, bit-exact keys ------------------------------------------------------------------------


def test_report_names_a_new_check_and_gate_refuses_unless_allowed(run):
    edit_experts(run, "rollout", lambda ids, routed, table: np.where(np.arange(4)[None, :, None] == 1, 0, ids))
    assert probe("report", run).exit_code == 0
    metrics = json.loads((run / "report/metrics.json").read_text())
    assert [f["check"] for f in metrics["findings"]] == ["routes_constant"]
    assert "Fix the setup: routes_constant" in (run / "report/index.html").read_text()  # it opens the page
    assert probe("gate", run, "--max", "k3_kl=10").exit_code == 1
    assert probe("gate", run, "--max", "k3_kl=10", "--allow", "routes_constant").exit_code == 0


def _metrics(run: Path) -> dict:
    assert probe("report", run).exit_code == 0
    document = json.loads((run / "report/metrics.json").read_text())
    return {(c["reference"], c["candidate"]): c["metrics"] for c in document["comparisons"]}


def test_bit_mismatch_keys_identical_and_perturbed_sides(run):
    """pass2 made a bitwise copy of pass1: no mismatch. Then 7 response tokens of pass2 moved by one float32
    ulp, and one token written as +0.0 on pass1 and -0.0 on pass2, which count as equal."""
    for part in sorted((run / PASS2).glob("part-*.parquet")):
        part.unlink()
    for part in sorted((run / BASE).glob("part-*.parquet")):
        shutil.copy(part, run / PASS2 / part.name)
    same = _metrics(run)[(BASE, PASS2)]
    assert same["logprob_bit_mismatch_count"] == 0 and same["logprob_bit_mismatch_fraction"] == 0.0
    assert same["k3_kl"] == 0.0
    assert "bitwise equal" in (run / "report/index.html").read_text()  # the page says so

    table = pl.read_parquet(run / PASS2 / "*.parquet")
    response = np.flatnonzero(table["is_response"].to_numpy() & table["logprob"].is_not_null().to_numpy())
    moved, zero = response[[1, 5, 9, 20, 33, 41, 60]], response[70]

    def written(values: np.ndarray):
        keyed = table.select("sample_id", "position").with_columns(new=pl.Series(values, dtype=pl.Float32))
        keys = ["sample_id", "position"]
        return lambda d: d.join(keyed, on=keys, how="left").with_columns(logprob=pl.col("new")).select(d.columns)

    values = table["logprob"].to_numpy().astype(np.float32)
    base = values.copy()
    base[zero] = 0.0
    values = values.copy()
    values[moved] = np.nextafter(values[moved], np.float32(-np.inf))
    values[zero] = -0.0
    edit(run, BASE, written(base))
    edit(run, PASS2, written(values))
    assert np.signbit(pl.read_parquet(run / PASS2 / "*.parquet")["logprob"].to_numpy()[zero])
    other = _metrics(run)[(BASE, PASS2)]
    assert other["logprob_bit_mismatch_count"] == len(moved)
    assert other["logprob_bit_mismatch_fraction"] == pytest.approx(len(moved) / other["n_tokens"])
    page = (run / "report/index.html").read_text()
    assert "bitwise equal" not in page and f"{len(moved)} differ in some bit" in page


def test_position_onset_at_96_on_long_responses(tmp_path):
    """The published case: equal up to position 96, apart after (an fp8 KV cache with FA3). The demo's
    responses end well before 96, so this run is synthetic: 48 responses of 150-224 tokens, the score set's
    log-probs the rollout's plus noise (sigma 0.01), the rollout's a step worse from position 96 on."""
    from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

    spec = SyntheticSpec(n_samples=48, prompt_len=(4, 12), response_len=(150, 224), score_sets=(ScoreSetSpec("t"),))
    root = write_synthetic_run(tmp_path / "run", spec)
    assert checks(root) == []
    after = pl.col("is_response") & (pl.col("position") >= 96)
    edit(root, "rollout", lambda d: d.with_columns(logprob=pl.when(after).then(pl.col("logprob") - 0.05)
                                                   .otherwise(pl.col("logprob"))))  # fmt: skip
    finding = only(root, "position_onset")
    assert finding.evidence["onset_position"] == 96
    before, later = finding.evidence["before"], finding.evidence["after"]
    assert before["ci95"][0] < before["mean_abs_delta"] < before["ci95"][1] < later["ci95"][0]
    assert later["mean_abs_delta"] == pytest.approx(0.05, abs=0.01)


@pytest.mark.parametrize(("logprob", "fires"), [(-30.0, True), (-0.7, False)])
def test_one_cloned_group_among_many_samples(logprob, fires):
    """50 prompts x 8 samples; one group holds 4 copies of a response. With log-prob -30 (a long response)
    chance gives that twin 7e-13 of a time: clones. With -0.7 (p = 0.5, one likely answer) every group is
    expected to repeat it, and 4 twins are nothing."""
    from mismatch_probe.doctor.stats.duplicates import too_many_twins, twins

    n = 400
    group = np.repeat(np.arange(50), 8).astype(np.float64)
    response = np.arange(n, dtype=np.float64)
    response[[8, 9, 10, 11]] = 8  # sample 8's response, four times in prompt 1
    table = {
        "sample_id": np.arange(n, dtype=np.float64),
        "prompt_h1": group,
        "prompt_h2": group,
        "prompt_len": np.full(n, 5.0),
        "resp_h1": response,
        "resp_h2": response,
        "resp_len": np.full(n, 20.0),
        "lp_ref": np.full(n, logprob),
        "lp_cand": np.full(n, logprob),
        "n_lp_ref": np.full(n, 20.0),
        "n_lp_cand": np.full(n, 20.0),
    }
    d = twins(table)
    assert d["twins"] == 4 and d["groups_with_twins"] == 1
    chance = 1 - (1 - np.exp(logprob)) ** 7  # each sample against its 7 group mates
    assert d["expected"] == pytest.approx(n * chance)
    assert too_many_twins(d) is fires


def test_routes_constant_in_every_layer_is_named_once(run):
    """No layer of the rollout captured: zeros everywhere. routes_constant names the four layers; the rows
    of zeros are not also holes (routes_invalid)."""
    edit_experts(run, "rollout", lambda ids, routed, table: np.zeros_like(ids))
    finding = only(run, "routes_constant")
    assert finding.evidence["layers"] == finding.evidence["all_zero_layers"] == [0, 1, 2, 3]
