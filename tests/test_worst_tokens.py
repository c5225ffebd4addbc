"""worst_tokens and breakdowns against a naive per-token implementation; decoding with a real tokenizer; the CLI."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DEMO_DENSE
from naive_metrics import naive_breakdowns, naive_worst, read_side
from rich.console import Console
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.frames.pair_frame import ResponseIndex
from mismatch_probe.report.build import build_report
from mismatch_probe.report.render.terminal.worst import worst_table
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

CAND = "scores/cand"
SHAPES = {
    "moe": dict(num_layers=3, top_k=2, num_experts=8),
    "moe-cand-without-top-and-routing": dict(num_layers=3, top_k=2, num_experts=8),
    "dense": dict(num_layers=0, top_k=0, num_experts=0),
}
TIE, BIG = 4.0, 8.0
# (n-th response row of the run, logprob_ref, logprob_cand): four |delta| = 4 ties and one 8, exact in float32.
PLANTED = [(3, -0.5, -4.5), (40, -4.5, -0.5), (41, -0.5, -4.5), (90, -4.5, -0.5), (120, -0.25, -8.25)]


def _rewrite(side_dir, row_group_size: int, edit) -> None:
    for path in sorted(side_dir.glob("part-*.parquet")):
        pq.write_table(edit(pq.read_table(path)), path, row_group_size=row_group_size)


def _plant(table: pa.Table, values: dict[int, float]) -> pa.Table:
    logprob = table.column("logprob").to_numpy(zero_copy_only=False).astype(np.float32)
    response_rows = np.flatnonzero(table.column("is_response").to_numpy(zero_copy_only=False))
    for k, value in values.items():
        logprob[response_rows[k]] = value
    valid = table.column("logprob").is_valid()
    column = pa.array(logprob, type=pa.float32(), mask=pa.compute.invert(valid).to_numpy(zero_copy_only=False))
    return table.set_column(table.schema.get_field_index("logprob"), "logprob", column)


def planted_run(tmp_path, kind: str):
    routing = kind != "moe-cand-without-top-and-routing"
    spec = SyntheticSpec(
        **SHAPES[kind],
        n_samples=24,
        prompt_len=(2, 5),
        response_len=(3, 12),
        seed=5,
        score_sets=(
            ScoreSetSpec("cand", logprob_sigma=0.3, route_fraction=0.3, nonfinite_fraction=0.1, routing=routing),
        ),
    )
    root = write_synthetic_run(tmp_path / kind, spec)
    _rewrite(root / "rollout", 11, lambda t: _plant(t, {k: ref for k, ref, _ in PLANTED}))

    def cand(table):
        table = _plant(table, {k: c for k, _, c in PLANTED})
        return table if routing else table.drop_columns(["top_token_id", "top_logprob"])

    _rewrite(root / CAND, 5, cand)  # row groups unlike the rollout's, cutting through sequences
    return root, spec


@pytest.mark.parametrize("kind", list(SHAPES))
def test_worst_tokens_and_breakdowns_match_naive(tmp_path, kind):
    root, spec = planted_run(tmp_path, kind)
    ref_rows, cand_rows = read_side(root / "rollout"), read_side(root / CAND)
    # Chunks of at most 5 rows (most sequences split, ties across chunks), then one chunk (ties cut inside it).
    for chunking, n in [("small", 3), ("small", 20), ("small", 0), ("small", 10_000), ("one", 3), ("one", 20)]:
        if chunking == "one":
            for side in (root / "rollout", root / CAND):
                _rewrite(side, 1 << 20, lambda table: table)
        comp = build_report(root, pairs=[("rollout", CAND)], worst=n, render=False).metrics["comparisons"][0]
        want = naive_worst(ref_rows, cand_rows, n, spec.num_layers, spec.top_k)
        got = comp["worst_tokens"]
        assert len(got) == len(want) == min(n, comp["metrics"]["n_tokens"])
        for g, w in zip(got, want):
            assert _same(g, w), (n, g, w)
            assert g["token"] is None and g["context"] == {"prompt_tail": None, "response_before": None}
    three = [(e["sample_id"], e["position"], abs(e["delta"])) for e in naive_worst(ref_rows, cand_rows, 3)]
    assert [d for *_, d in three] == [BIG, TIE, TIE]  # the planted ones; ties to the smaller (sample, position)
    assert sum(1 for e in naive_worst(ref_rows, cand_rows, 10) if abs(e["delta"]) == TIE) == 4
    if kind == "moe":
        assert any(e["routing_diff_layers"] for e in comp["worst_tokens"])
        assert any(e["routing_diff_layers"] is None for e in comp["worst_tokens"])  # last token: no rollout routing
        assert any(e["top_token_id_ref"] != e["top_token_id_cand"] for e in comp["worst_tokens"])
    else:
        assert all(e["routing_diff_layers"] is None for e in comp["worst_tokens"])
    if kind == "moe-cand-without-top-and-routing":
        assert all(e["top_token_id_cand"] is None and e["top_token_id_ref"] is not None for e in comp["worst_tokens"])
    assert comp["metrics"]["n_nonfinite_cand"] > 0
    assert "worst_tokens: token texts are null: model folder synthetic not found" in comp["notes"]
    _assert_breakdowns(comp, naive_breakdowns(ref_rows, cand_rows))


def _same(got: dict, want: dict) -> bool:
    """Equal on every key of `want`: floats to rounding, everything else exactly."""
    return all(
        got[k] == pytest.approx(v, rel=1e-12) if isinstance(v, float) else got[k] == v and type(got[k]) is type(v)
        for k, v in want.items()
    )


def _assert_breakdowns(comp: dict, want: dict) -> None:
    assert set(comp["breakdowns"]) == set(want)
    for name, expected in want.items():
        got = comp["breakdowns"][name]
        assert set(got) == set(expected)
        assert got["edges"] == pytest.approx(expected["edges"]) and got["n_tokens"] == expected["n_tokens"]
        for key, values in expected.items():
            assert [v is None for v in got[key]] == [v is None for v in values], (name, key)
            assert [v for v in got[key] if v is not None] == pytest.approx(
                [v for v in values if v is not None], rel=1e-9
            )
        metrics = comp["metrics"]
        assert sum(got["n_tokens"]) == metrics["n_tokens"]
        extreme = sum(f * n for f, n in zip(got["extreme_fraction@1.5"], got["n_tokens"]) if f is not None)
        assert extreme == pytest.approx(metrics["extreme_fraction@1.5"] * metrics["n_tokens"])
    assert None in comp["breakdowns"]["by_ref_prob"]["k3_kl"]  # an empty bin has null means


def test_response_index_carried_across_chunk_cuts():
    # sample 3: prompt of 2 then 3 response tokens; sample 4: prompt of 1 then 4; sample 5: prompt only.
    sample = np.array([3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 5, 5], dtype=np.uint32)
    position = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], dtype=np.uint32)
    response = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=bool)
    want = np.array([0, 1, 2, 0, 1, 2, 3])
    for cuts in ([], [3], [4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [6, 7], [10]):
        tracker, got = ResponseIndex(), []
        for s, p, r in zip(*(np.split(a, cuts) for a in (sample, position, response))):
            got.append(tracker.update(s, p, r)[r])
        assert np.array_equal(np.concatenate(got), want), cuts


def _decoded_run(tmp_path, model: str):
    spec = SyntheticSpec(
        num_layers=2,
        top_k=2,
        num_experts=8,
        n_samples=10,
        prompt_len=(3, 40),
        response_len=(3, 12),
        vocab_size=500,
        score_sets=(ScoreSetSpec("cand", logprob_sigma=0.5),),
    )
    root = write_synthetic_run(tmp_path / "run", spec)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps(manifest | {"model": model}))
    return root


def test_context_is_the_decoded_stored_ids(tmp_path):
    from transformers import AutoTokenizer

    root = _decoded_run(tmp_path, str(DEMO_DENSE))
    build_report(root, worst=6, render=False)
    comp = json.loads((root / "report" / "metrics.json").read_text())["comparisons"][0]
    assert len(comp["worst_tokens"]) == 6 and not any("worst_tokens" in n for n in comp["notes"])
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DENSE)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    rows = read_side(root / "rollout")
    for e in comp["worst_tokens"]:
        sample = [r for r in rows if r["sample_id"] == e["sample_id"]]
        prompt = [r["token_id"] for r in sample if not r["is_response"]]
        before = [r["token_id"] for r in sample if r["is_response"] and r["position"] < e["position"]]
        assert len(prompt) + len(before) == e["position"] and sample[e["position"]]["token_id"] == e["token_id"]
        assert e["context"] == {"prompt_tail": decode(prompt[-32:]), "response_before": decode(before)}
        assert e["token"] == decode([e["token_id"]]) and e["top_token_ref"] == decode([e["top_token_id_ref"]])
        assert e["top_token_cand"] == decode([e["top_token_id_cand"]])
    assert any(e["context"]["response_before"] for e in comp["worst_tokens"])


@pytest.mark.parametrize("model", ["gone", "empty"])
def test_report_without_a_loadable_tokenizer_keeps_ids_and_says_why(tmp_path, model):
    folder = tmp_path / model
    if model == "empty":
        folder.mkdir()
    root = _decoded_run(tmp_path, str(folder))
    comp = build_report(root, worst=4, render=False).metrics["comparisons"][0]
    assert len(comp["worst_tokens"]) == 4
    assert all(
        e["token"] is None and e["top_token_ref"] is None and e["context"]["prompt_tail"] is None
        for e in comp["worst_tokens"]
    )
    assert all(isinstance(e["token_id"], int) and isinstance(e["top_token_id_ref"], int) for e in comp["worst_tokens"])
    (note,) = [n for n in comp["notes"] if n.startswith("worst_tokens")]
    assert "\n" not in note
    if model == "gone":
        assert note == f"worst_tokens: token texts are null: model folder {folder} not found"
    else:
        assert note.startswith(f"worst_tokens: token texts are null: cannot load the tokenizer of {folder} (")


def test_cli_worst_prints_the_table_and_refuses_bad_counts(tmp_path):
    root = _decoded_run(tmp_path, str(DEMO_DENSE))
    runner = CliRunner()
    result = runner.invoke(app, ["report", str(root), "--worst", "3"])
    assert result.exit_code == 0, result.output
    assert "worst tokens: rollout vs scores/cand" in result.output
    metrics = json.loads((root / "report" / "metrics.json").read_text())
    assert [len(c["worst_tokens"]) for c in metrics["comparisons"]] == [3]
    bad = runner.invoke(app, ["report", str(root), "--worst", "-1"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: --worst: -1, expected an integer >= 0"
    assert runner.invoke(app, ["report", str(root), "--worst", "two"]).exit_code == 2


def test_terminal_table_shows_model_text_literally():
    entry = {
        "sample_id": 1,
        "position": 9,
        "response_index": 2,
        "token_id": 7,
        "token": "[bold]x[/bold]",
        "logprob_ref": -0.1,
        "logprob_cand": -3.0,
        "p_ref": 0.905,
        "p_cand": 0.0498,
        "delta": -2.9,
        "top_token_id_ref": 7,
        "top_token_id_cand": 8,
        "top_token_ref": "[red]",
        "top_token_cand": None,
        "routing_diff_layers": None,
        "context": {"prompt_tail": "Q:\n", "response_before": "[/]a"},
    }
    console = Console(record=True, width=250)
    console.print(worst_table({"reference": "rollout", "candidate": "scores/[b]", "worst_tokens": [entry]}))
    text = console.export_text()
    assert "[bold]x[/bold]" in text and "[red]" in text and "Q:\\n[/]a[bold]x[/bold]" in text
    assert "scores/[b]" in text and "id 8" in text and "-2.9" in text
