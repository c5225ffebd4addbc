"""`probe import`: what a dump says of its sampling lands in the rollout manifest's `sampling` (and its
temperature is both sides' scoring temperature); what it does not say is listed in `not_in_source`.

Of the five formats only verl's batch carries sampling settings: its trainer sets meta_info["temperature"]
(verl/trainer/ppo/ray_trainer.py). slime's and miles' Sample dicts, prime-rl's token exports and NeMo-RL's
train data hold none. Every format's import writes both sides; the one dump that holds the rollout alone,
slime's --save-debug-rollout-data, is refused with exit 2 (it has no training log-probs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from import_dumps import make_seqs, write_miles, write_nemo_rl, write_prime_rl, write_slime_rollout, write_verl_step
from typer.testing import CliRunner

from mismatch_probe.cli import app

FIXTURE = Path(__file__).parent / "fixtures" / "import" / "verl_step1.pkl"
NO_TOP = "top_p and top_k: not in the source; whether the rollout's log-probs are over a truncated support is not known"


def probe(*argv):
    return CliRunner().invoke(app, [str(a) for a in argv], catch_exceptions=False)


def manifests(run: Path) -> tuple[dict, dict]:
    rollout = json.loads((run / "manifest.json").read_text())
    return rollout, json.loads((run / "scores" / "training" / "manifest.json").read_text())


def test_verl_meta_info_sampling_is_recorded(tmp_path):
    dump = write_verl_step(FIXTURE, tmp_path / "dump" / "step_1.pkl", 1, {"temperature": 0.7, "top_p": 0.9})
    result = probe("import", "verl", dump, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    rollout, score = manifests(tmp_path / "run")
    assert rollout["sampling"] == {"temperature": 0.7, "top_p": 0.9}
    assert rollout["scoring_temperature"] == score["temperature"] == 0.7
    assert "temperature: not in the source" not in result.output and NO_TOP not in result.output
    assert not any(line.startswith(("temperature", "top_p")) for line in rollout["not_in_source"])


def test_a_stated_temperature_the_dump_contradicts_is_refused(tmp_path):
    dump = write_verl_step(FIXTURE, tmp_path / "dump" / "step_1.pkl", 1, {"temperature": 0.7})
    result = probe("import", "verl", dump, "--out", tmp_path / "run", "--temperature", 1.0)
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: {dump}: meta_info: the dump samples at temperature 0.7, but --temperature is 1.0"
    )
    assert not (tmp_path / "run").exists()
    agreeing = probe("import", "verl", dump, "--out", tmp_path / "run", "--temperature", 0.7)
    assert agreeing.exit_code == 0, agreeing.output


def test_steps_that_sample_differently_are_refused(tmp_path):
    write_verl_step(FIXTURE, tmp_path / "dump" / "step_1.pkl", 1, {"temperature": 0.7})
    second = write_verl_step(FIXTURE, tmp_path / "dump" / "step_2.pkl", 2, {"temperature": 1.0})
    result = probe("import", "verl", tmp_path / "dump", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: {second}: meta_info: temperature 1.0, but 0.7 earlier in the dump (one run samples one way)"
    )


def test_a_verl_batch_without_sampling_says_so(tmp_path):
    result = probe("import", "verl", FIXTURE, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    rollout, score = manifests(tmp_path / "run")
    assert rollout["sampling"] is None and rollout["scoring_temperature"] is None and score["temperature"] is None
    assert NO_TOP in rollout["not_in_source"] and NO_TOP in " ".join(result.output.split())


@pytest.mark.parametrize(
    "fmt, write",
    [
        ("miles", write_miles),
        ("prime-rl", write_prime_rl),
        ("nemo-rl", write_nemo_rl),
    ],
)
def test_formats_without_sampling_record_none(tmp_path, fmt, write):
    dump = write(tmp_path / "dump", make_seqs())
    result = probe("import", fmt, dump, "--out", tmp_path / "run", "--temperature", 0.8)
    assert result.exit_code == 0, result.output
    rollout, score = manifests(tmp_path / "run")
    assert rollout["sampling"] is None  # --temperature states the scoring temperature, not what the dump says
    assert rollout["scoring_temperature"] == score["temperature"] == 0.8
    assert NO_TOP in rollout["not_in_source"]


def test_the_rollout_only_dump_is_refused_with_its_line(tmp_path):
    """slime's --save-debug-rollout-data: the only rollout-only dump of the five formats, exit 2 whatever
    --temperature says (its missing training log-probs, not its sampling, make it unusable)."""
    dump = write_slime_rollout(tmp_path / "rollout_data" / "3.pt", make_seqs())
    for extra in ((), ("--temperature", "1.0")):
        result = probe("import", "slime", dump, "--out", tmp_path / "run", *extra)
        assert result.exit_code == 2
        assert result.output.strip() == (
            f"error: {dump}: a rollout dump (--save-debug-rollout-data) holds no training log-probs ('log_probs'): "
            "the rollout-vs-training comparison cannot be made; import the --save-debug-train-data dump of this "
            "rollout"
        )
        assert not (tmp_path / "run").exists()
