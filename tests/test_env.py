"""`probe env`: the versions that change probe's numbers, and for each engine whether it runs here and why not."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from typer.testing import CliRunner

from mismatch_probe import environment
from mismatch_probe.cli import app
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset


def _env_json() -> dict:
    result = CliRunner().invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_json_names_the_installed_versions():
    found = _env_json()
    for dist in ("torch", "transformers", "pyarrow", "numpy", "typer", "rich"):
        assert found["packages"][dist] == metadata.version(dist)
    assert set(environment.PACKAGES) == set(found["packages"])
    assert found["python"].startswith(".".join(map(str, __import__("sys").version_info[:2])))
    engines = {(e["kind"], e["name"]): e for e in found["engines"]}
    assert set(engines) == {
        ("inference", name) for name in ("hf", "sglang", "vllm", "sglang-offline", "vllm-offline")
    } | {("training", "hf"), ("training", "megatron")}
    assert engines["training", "hf"]["runs"] and engines["inference", "hf"]["runs"]
    import torch

    device = "CUDA" if torch.cuda.is_available() else "CPU"
    assert f"on {device}" in engines["training", "hf"]["why"]
    assert found["cuda"] == torch.version.cuda


def test_table_lists_every_engine():
    result = CliRunner().invoke(app, ["env"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    for name in ("pyarrow", "megatron-core", "sglang-offline", "vllm-offline", "megatron", "runs here"):
        assert name in result.output


def test_install_hints_keep_their_extras_in_the_table(monkeypatch):
    real = environment.installed
    monkeypatch.setattr(environment, "installed", lambda dist: None if dist == "sglang" else real(dist))
    result = CliRunner().invoke(app, ["env"], env={"COLUMNS": "240"})
    assert "pip install 'mismatch-probe[sglang]'" in result.output  # not eaten as rich markup


@pytest.mark.parametrize(
    "version, why",
    [
        (None, "megatron-core is not installed (pip install 'mismatch-probe[megatron]')"),
        ("0.17.0", "megatron-core 0.17.0 is installed; probe's shims are for 0.16.1 only"),
    ],
)
def test_megatron_that_cannot_run_says_why_in_one_line(monkeypatch, version, why):
    real = environment.installed
    monkeypatch.setattr(environment, "installed", lambda dist: version if dist == "megatron-core" else real(dist))
    megatron = [e for e in environment.collect().engines if e.name == "megatron"][0]
    assert (megatron.runs, megatron.why) == (False, why)


def test_an_engine_package_that_fails_to_import_is_named(monkeypatch):
    monkeypatch.setattr(environment, "installed", lambda dist: "1.0" if dist == "vllm" else None)
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # import vllm now raises ImportError
    vllm = [e for e in environment.collect().engines if e.name == "vllm-offline"][0]
    assert not vllm.runs and vllm.why.startswith("vllm does not import (ModuleNotFoundError: ")
    assert "\n" not in vllm.why


def test_hf_names_the_families_its_transformers_is_too_old_for(monkeypatch):
    real = environment.installed
    monkeypatch.setattr(environment, "installed", lambda dist: "5.6.0" if dist == "transformers" else real(dist))
    hf = [e for e in environment.collect().engines if e.name == "hf" and e.kind == "training"][0]
    assert hf.runs and hf.why.startswith("transformers 5.6.0 on ")
    assert hf.why.endswith(
        "; DeepSeek-V3 / Kimi-K2, GLM-4.5, dots1, ERNIE-4.5-MoE, Hunyuan-MoE-V1: need transformers >= 5.13"
    ), hf.why
    monkeypatch.setattr(environment, "installed", lambda dist: "5.24.0" if dist == "transformers" else real(dist))
    hf = [e for e in environment.collect().engines if e.name == "hf" and e.kind == "training"][0]
    assert "need transformers" not in hf.why


def test_env_of_a_run_shows_each_sides_quantization_and_sampling(tmp_path):
    spec = SyntheticSpec(n_samples=4, prompt_len=(2, 3), response_len=(3, 4), score_sets=(ScoreSetSpec("s"),))
    run = write_synthetic_run(tmp_path / "run", spec)
    quantization = {"weight": "fp8-block128", "act": "fp8-token128", "kv": None, "quantized_modules": ["a"]}
    sampling = {"temperature": 1.0, "top_p": 0.7, "top_k": 0, "logprobs_mode": "processed"}
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"quantization": quantization, "sampling": sampling}))

    result = CliRunner().invoke(app, ["env", str(run), "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["run"]["path"] == str(run)
    rollout, scores = found["run"]["sides"]
    assert rollout["side"] == "rollout" and rollout["quantization"] == quantization
    assert rollout["sampling"] == sampling
    assert (
        rollout["setup"] == "weight fp8-block128, act fp8-token128, kv none; sampling T=1 top_p=0.7 top_k=0 processed"
    )
    assert (scores["side"], scores["quantization"]) == ("scores/s", None)
    assert scores["setup"].startswith("not quantized; sampling T=")

    text = CliRunner().invoke(app, ["env", str(run)], env={"COLUMNS": "240"})
    assert text.exit_code == 0, text.output
    assert "weight fp8-block128, act fp8-token128, kv none; sampling T=1 top_p=0.7 top_k=0 processed" in text.output
    assert "scores/s" in text.output


def test_env_of_a_missing_run_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["env", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.output.strip() == f"error: {tmp_path / 'nope'}: run directory not found"
