"""The rollout and score-set manifests: JSON round trip, keys from newer versions kept, missing keys refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.layout import Run
from mismatch_probe.rundir.manifests import RolloutManifest, ScoreManifest
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

# As `probe generate` writes it (sglang engine), plus keys a newer version might add.
ROLLOUT = {
    "schema_version": 1,
    "created_at": "2026-01-01T00:00:00+00:00",
    "status": "complete",
    "engine": {"engine": "sglang", "server_version": "0.5.23", "server_args": {"tp_size": 1}, "cached_tokens": 0},
    "dtype": "bf16",
    "quantization": None,
    "versions": {"mismatch-probe": "0.1.0", "torch": "2.13.0"},
    "tool_version": "0.1.0",
    "model": "/models/q",
    "model_type": "qwen3_moe",
    "architecture": "Qwen3MoeForCausalLM",
    "config_hash": "ab12",
    "num_hidden_layers": 4,
    "vocab_size": 512,
    "num_layers": 4,
    "top_k": 2,
    "num_experts": 16,
    "moe_layer_indices": [0, 1, 2, 3],
    "sampling": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_new_tokens": 8,
        "seed": 0,
        "logprobs_mode": "processed",
    },
    "scoring_temperature": 1.0,
    "seed": 0,
    "prompts_file": "/p.jsonl",
    "prompts_sha256": "ff",
    "num_prompts": 2,
    "samples_per_prompt": 1,
    "num_samples": 2,
    "batch_size": 16,
    "window_size": 32,
    "completed_samples": 2,
    "weights_sha256": "ab" * 32,
    "tokens_per_second": 812.5,
    "engine_options": {"device": "auto", "weight_quant": None},
    "eos_token_ids": [1, 2],
    "incomplete": None,
}
SCORE = {
    "schema_version": 1,
    "created_at": "2026-01-01T00:00:00+00:00",
    "status": "complete",
    "engine": {"engine": "hf", "dtype": "bf16"},
    "dtype": "bf16",
    "quantization": None,
    "versions": {"torch": "2.13.0"},
    "name": "hf-bf16-pass2",
    "role": "repeats",
    "replay": "none",
    "temperature": 1.0,
    "repeat_group": "hf-bf16",
    "pass_index": 2,
    "repeats": 2,
    "batch_layout": {"micro_batch": 4, "shuffle_seed": 2, "extra_padding": 5},
    "model": "/models/q",
    "config_hash": "ab12",
    "rollout_created_at": "2026-01-01T00:00:00+00:00",
    "weights_sha256": "cd" * 32,
    "incomplete": {"stopped_at": "part-00002.parquet", "parts_done": 2, "parts": 5, "why": "out of memory"},
    "policy": {"role": "new", "step": 2, "old": "hf-fp32", "replay_source": "scores/hf-fp32"},
    "sampling": {"temperature": 1.0, "top_p": 0.7, "top_k": 0, "logprobs_mode": "processed"},
    "n_outside_support": 3,
    "tokens_per_second": 2048.0,
    "engine_options": {"device": "auto", "logprob_chunk": 256},
    "kind": None,
    "prefill": None,
}
NEWER = {"router_logits_sha": "0badc0de", "extra": {"nested": [1, 2]}}  # "extra" must not collide with the field


@pytest.mark.parametrize("cls, data", [(RolloutManifest, ROLLOUT), (ScoreManifest, SCORE)])
def test_round_trip_keeps_every_key_and_value(cls, data, tmp_path):
    obj = {**data, **NEWER}
    manifest = cls.from_json(obj, Path("manifest.json"))
    assert manifest.to_json() == obj
    assert list(manifest.to_json())[: len(data)] == list(data)  # known keys keep the order users see on disk
    assert manifest.extra == NEWER
    manifest.save(tmp_path / "manifest.json")
    again = cls.load(tmp_path / "manifest.json")
    assert again == manifest and json.loads((tmp_path / "manifest.json").read_text()) == obj


def test_fields_are_attributes():
    rollout = RolloutManifest.from_json(ROLLOUT, Path("m.json"))
    assert (rollout.routing.num_layers, rollout.routing.top_k, rollout.routing.num_experts) == (4, 2, 16)
    assert rollout.engine_name == "sglang" and rollout.sampling["max_new_tokens"] == 8
    score = ScoreManifest.from_json(SCORE, Path("m.json"))
    assert (score.engine_name, score.repeat_group, score.pass_index) == ("hf", "hf-bf16", 2)
    assert ScoreManifest.from_json({**SCORE, "engine": "synthetic"}, Path("m.json")).engine_name == "synthetic"


@pytest.mark.parametrize("key", ["schema_version", "model", "config_hash", "num_layers", "scoring_temperature"])
def test_missing_rollout_key_names_file_and_key(key):
    data = {k: v for k, v in ROLLOUT.items() if k != key}
    with pytest.raises(ProbeError) as err:
        RolloutManifest.from_json(data, Path("/runs/a/manifest.json"))
    assert str(err.value) == (
        f"/runs/a/manifest.json: missing '{key}' (expected a rollout manifest written by `probe generate`)"
    )
    assert err.value.exit_code == 2


@pytest.mark.parametrize("key", ["temperature", "config_hash"])
def test_missing_score_key_names_file_and_key(key):
    data = {k: v for k, v in SCORE.items() if k != key}
    with pytest.raises(ProbeError) as err:
        ScoreManifest.from_json(data, Path("/runs/a/scores/x/manifest.json"))
    assert str(err.value) == (
        f"/runs/a/scores/x/manifest.json: missing '{key}' (expected a score-set manifest written by `probe rescore`)"
    )


def test_optional_keys_may_be_absent():
    required = {
        k: ROLLOUT[k]
        for k in ("schema_version", "model", "config_hash", "num_layers", "top_k", "num_experts", "scoring_temperature")
    }
    manifest = RolloutManifest.from_json(required, Path("m.json"))
    assert manifest.status is None and manifest.engine_name is None and manifest.extra == {}


@pytest.fixture
def run(tmp_path) -> Path:
    spec = SyntheticSpec(n_samples=4, prompt_len=(2, 3), response_len=(3, 4), score_sets=(ScoreSetSpec("s"),))
    return write_synthetic_run(tmp_path / "run", spec)


def _edit(path: Path, drop: str | None = None, **changes) -> None:
    data = json.loads(path.read_text())
    data.pop(drop, None)
    path.write_text(json.dumps(data | changes))


def _error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return next(line for line in result.output.splitlines() if line.startswith("error:"))


@pytest.mark.parametrize("command", [["report"], ["gate", "--max", "k3_kl=1"], ["rescore"]])
def test_cli_refuses_a_rollout_manifest_without_a_required_key(run, command):
    _edit(run / "manifest.json", drop="config_hash")
    result = CliRunner().invoke(app, [command[0], str(run), *command[1:]])
    assert _error_line(result) == (
        f"error: {run / 'manifest.json'}: missing 'config_hash' (expected a rollout manifest written by `probe generate`)"
    )


def test_cli_refuses_a_score_manifest_without_a_required_key(run):
    path = run / "scores" / "s" / "manifest.json"
    _edit(path, drop="temperature")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert _error_line(result) == (
        f"error: {path}: missing 'temperature' (expected a score-set manifest written by `probe rescore`)"
    )


def test_report_reads_manifests_with_keys_from_a_newer_version(run):
    _edit(run / "manifest.json", router_logits_sha="0badc0de")
    _edit(run / "scores" / "s" / "manifest.json", kernel="flash-9")
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert Run(run).manifest().extra == {"router_logits_sha": "0badc0de"}


def test_sides_table_is_one_short_line_per_side(run):
    _edit(run / "manifest.json", dtype=None, engine={"engine": "sglang", "server_args": {"tp_size": 8}})
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    html = (run / "report" / "index.html").read_text()
    run_section = html[html.index('<section id="run">') :]
    sides = run_section[: run_section.index("</details>")]  # the sides table, folded first
    cells = [re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", sides)]
    assert cells == [
        ["side", "produced by", "quantization; sampling"],
        [
            "rollout",
            "engine sglang · dtype unknown · the sampled rollout",
            "not quantized; sampling T=1 top_p=1 top_k=-1",
        ],
        ["scores/s", "engine synthetic · dtype bfloat16 · replay none", "not quantized; sampling T=1 raw"],
    ]
    # the folded manifests flatten nested settings into plain rows: no JSON for the reader to parse
    manifests = run_section[run_section.index("</details>") :]
    assert "<td>engine.server_<wbr>args.tp_<wbr>size</td><td>8</td>" in manifests
    assert "{" not in manifests.split("<script>")[0]
