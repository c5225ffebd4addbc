"""Engine options: `--engine-arg KEY=VALUE` parsed by each engine's Options dataclass, `--help-engine`,
and the old flags as aliases that take the same path."""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl
import pytest
from fake_servers import FIXTURE_MODEL, FIXTURE_PROMPT, ReplayServer, sglang_routes
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.cli_args import engine_args, engine_help
from mismatch_probe.engines.options import build_options, option, parse_engine_args
from mismatch_probe.engines.serving.server_engine import ServerOptions
from mismatch_probe.errors import ProbeError


@dataclass(frozen=True)
class Knobs:
    count: int = option(2, "how many", min=1)
    scale: float = option(0.5, "a factor")
    flag: bool = option(False, "on or off")
    label: str = option("x", "a name")
    url: str | None = option(None, "optional text")


def test_text_values_convert_by_field_type():
    knobs = build_options(
        Knobs, "demo", {"count": "7", "scale": "1e-3", "flag": "yes", "label": "a=b", "url": "http://h:1"}
    )
    assert knobs == Knobs(count=7, scale=1e-3, flag=True, label="a=b", url="http://h:1")
    assert build_options(Knobs, "demo", {"flag": "0", "url": "none"}) == Knobs(flag=False, url=None)
    assert build_options(Knobs, "demo", {}) == Knobs()


def test_typed_values_pass_the_same_checks():
    assert build_options(Knobs, "demo", {"count": 3, "scale": 2}) == Knobs(count=3, scale=2.0)
    with pytest.raises(ProbeError, match=r"^--engine-arg count=2.5: expected int$"):
        build_options(Knobs, "demo", {"count": 2.5})
    with pytest.raises(ProbeError, match=r"^--engine-arg count=True: expected int$"):
        build_options(Knobs, "demo", {"count": True})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("count", "many", "--engine-arg count=many: expected int"),
        ("count", "0", "--engine-arg count=0: expected int >= 1"),
        ("scale", "nan", "--engine-arg scale=nan: expected float"),
        ("flag", "maybe", "--engine-arg flag=maybe: expected bool"),
        (
            "bogus",
            "1",
            "--engine-arg bogus: unknown key for --engine demo (valid keys: count, scale, flag, label, url)",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_expected_type(key, value, message):
    with pytest.raises(ProbeError) as info:
        build_options(Knobs, "demo", {key: value})
    assert str(info.value) == message and info.value.exit_code == 2


def test_engine_arg_text_needs_key_and_value_once():
    assert parse_engine_args(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ProbeError, match=r"^--engine-arg 'a': expected KEY=VALUE, e.g. concurrency=16$"):
        parse_engine_args(["a"])
    with pytest.raises(ProbeError, match=r"^--engine-arg a: given twice \('1' and '2'\)$"):
        parse_engine_args(["a=1", "a=2"])


# ---- through the command line ------------------------------------------------------------------


def probe(*args: str):
    return CliRunner().invoke(app, list(args))


def test_cli_unknown_key_lists_the_valid_keys_exit_2(tmp_path):
    result = probe(
        "generate",
        "--model",
        "m",
        "--prompts",
        "p",
        "--out",
        str(tmp_path / "run"),
        "--engine",
        "vllm",
        "--engine-arg",
        "tp=2",
    )
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --engine-arg tp: unknown key for --engine vllm (valid keys: server_url, concurrency, timeout_s, "
        "ready_timeout_s, max_retries, retry_backoff_s, quantization, kv_cache_dtype)"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_cli_bad_type_names_key_and_type_exit_2(tmp_path):
    result = probe("rescore", str(tmp_path), "--engine", "megatron", "--engine-arg", "tensor_parallel=two")
    assert result.exit_code == 2
    assert result.output.strip() == "error: --engine-arg tensor_parallel=two: expected int"


def test_cli_alias_for_an_option_the_engine_lacks_exit_2(tmp_path):
    result = probe("rescore", str(tmp_path), "--engine", "hf", "--tp", "2")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --tp: --engine hf has no option 'tensor_parallel' (valid keys: logprob_chunk, device, device_map, weight_quant, weight_quant_skip, act_quant, kv_quant, quant_compute, attn_implementation, lm_head_dtype, router_dtype)"
    )
    both = probe("rescore", str(tmp_path), "--engine", "megatron", "--tp", "2", "--engine-arg", "tensor_parallel=2")
    assert both.exit_code == 2 and "--tp: also given as --engine-arg tensor_parallel=2; keep one" in both.output


@pytest.mark.parametrize("order", ["engine first", "help first"])
def test_help_engine_lists_options_with_defaults_and_help(order):
    args = ["--engine", "sglang", "--help-engine"]
    result = probe("generate", *(args if order == "engine first" else args[::-1][:1] + args[:2]))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "Options of the inference engine 'sglang', given as --engine-arg KEY=VALUE:"
    assert lines[1].split() == ["KEY", "TYPE", "DEFAULT", "HELP"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == ["server_url", "concurrency", "timeout_s", "ready_timeout_s", "max_retries", "retry_backoff_s"]
    assert rows["concurrency"].split()[:4] == ["concurrency", "int", "8", "requests"]
    assert rows["server_url"].split()[1:5] == ["str", "or", "none", "None"]


def test_help_engine_for_training_engines_and_hf():
    megatron = probe("rescore", "--engine", "megatron", "--help-engine").output.splitlines()
    assert [line.split()[0] for line in megatron[2:-1]] == [
        "logprob_chunk",
        "tensor_parallel",
        "expert_parallel",
        "config_file",
        "override_transformer_config.FIELD",
    ]
    assert megatron[-1].startswith("override_transformer_config.FIELD takes any TransformerConfig field")
    assert megatron[2].split()[:3] == ["logprob_chunk", "int", "256"]
    hf = probe("generate", "--help-engine").output.splitlines()  # hf, the default engine
    assert hf[0] == "Options of the inference engine 'hf', given as --engine-arg KEY=VALUE:"
    quant_and_knobs = [
        ["weight_quant", "str", "or"],
        ["weight_quant_skip", "str", "'default'"],
        ["act_quant", "str", "or"],
        ["kv_quant", "str", "or"],
        ["quant_compute", "str", "'auto'"],
        ["attn_implementation", "str", "or"],
        ["lm_head_dtype", "str", "or"],
        ["router_dtype", "str", "or"],
    ]
    assert [line.split()[:3] for line in hf[2:]] == [
        ["device", "str", "'auto'"],
        ["device_map", "str", "or"],
        *quant_and_knobs,
    ]
    hf = probe("rescore", "--engine", "hf", "--help-engine").output.splitlines()
    assert [line.split()[0] for line in hf[2:]] == [
        "logprob_chunk",
        "device",
        "device_map",
        *(q[0] for q in quant_and_knobs),
    ]
    unknown = probe("rescore", "--engine", "nope", "--help-engine")
    assert (
        unknown.exit_code == 2
        and "--engine: unknown training engine 'nope' (choose from: hf, megatron, sglang, vllm, sglang-offline, vllm-offline)"
        in unknown.output
    )


def test_help_engine_matches_the_dataclass():
    text = engine_help("inference", "vllm")
    for name, default in (("timeout_s", "600.0"), ("max_retries", "4"), ("retry_backoff_s", "1.0")):
        assert any(
            line.split()[:3] == [name, "float" if "." in default else "int", default] for line in text.splitlines()
        )
    assert ServerOptions().timeout_s == 600.0


def test_aliases_become_the_same_engine_args():
    old = engine_args(
        "inference",
        "sglang",
        [],
        {"--server-url": "http://h:1", "--concurrency": 3, "--timeout": 9.5, "--max-retries": 0},
    )
    new = engine_args(
        "inference", "sglang", ["server_url=http://h:1", "concurrency=3", "timeout_s=9.5", "max_retries=0"], {}
    )
    assert old == new == {"server_url": "http://h:1", "concurrency": "3", "timeout_s": "9.5", "max_retries": "0"}
    old = engine_args("training", "megatron", [], {"--tp": 2, "--ep": 4, "--logprob-chunk": 64})
    assert old == engine_args(
        "training", "megatron", ["tensor_parallel=2", "expert_parallel=4", "logprob_chunk=64"], {}
    )


def test_alias_and_engine_arg_runs_write_the_same_rollout(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": FIXTURE_PROMPT[: 5 + i]}) + "\n" for i in range(3)))
    tables, bodies, outputs = [], [], []
    for name, flags in (
        ("old", ["--server-url", "{url}", "--concurrency", "2"]),
        ("new", ["--engine-arg", "server_url={url}", "--engine-arg", "concurrency=2"]),
    ):
        with ReplayServer(sglang_routes()) as server:
            result = probe(
                "generate",
                "--model",
                str(FIXTURE_MODEL),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / name),
                "--engine",
                "sglang",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
                *[f.format(url=server.url) for f in flags],
            )
            bodies.append(sorted(server.calls_to("/generate"), key=json.dumps))  # arrival order varies
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
        tables.append(pl.read_parquet(tmp_path / name / "rollout").sort("sample_id", "position"))
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["window_size"] == 8  # concurrency 2 x 4, from either spelling
    assert tables[0].equals(tables[1]) and bodies[0] == bodies[1]
    assert "note: --server-url is deprecated; use --engine-arg server_url=http://127.0.0.1:" in outputs[0]
    assert "deprecated" not in outputs[1]
