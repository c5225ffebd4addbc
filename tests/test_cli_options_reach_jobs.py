"""Every option of every command reaches the work it configures.

Each command is invoked with a non-default value for every one of its options, with the function it hands
its work to replaced by a recorder, and each value is looked up where it must arrive. The options come from
the command itself (click's view of the app), so an option added without an entry here fails the test.
A job dataclass's fields must also be exactly the command's options (a flag once never reached its job)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
import typer.main
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.engines.base import EngineConfig, SamplingParams
from mismatch_probe.engines.cli_args import ALIASES
from mismatch_probe.environment import Environment
from mismatch_probe.importers import DumpFormat
from mismatch_probe.importers.job import ImportJob, ImportResult
from mismatch_probe.pipeline.generate import GenerateJob
from mismatch_probe.pipeline.rescore import RescoreJob
from mismatch_probe.pipeline.sweep.plan import SweepJob
from mismatch_probe.report.build import Report

pytestmark = pytest.mark.lane  # docs/development.md: the dependency lanes' subset

runner = CliRunner()
Calls = dict[str, dict[str, Any]]  # recorded function name -> its arguments by parameter name


@dataclass(frozen=True)
class Given:
    argv: tuple[str, ...]  # the option and its value on the command line
    arrived: Callable[[Calls], Any]  # where the value must show up
    expected: Any


@dataclass(frozen=True)
class Case:
    patched: dict[str, Any]  # "module:function" -> what the recorder returns
    scenarios: tuple[dict[str, Given], ...]  # one command line each; keyed by the option's parameter name


def _job(function: str) -> Callable[[Calls], Any]:
    return lambda calls: calls[function]["job"]


def _arg(function: str, name: str) -> Callable[[Calls], Any]:
    return lambda calls: calls[function][name]


def _option(name: str) -> Callable[[Calls], Any]:
    """A report option: build_report takes them as keyword arguments by name (report/keys/request.py OPTIONS)."""
    return lambda calls: calls["build_report"]["options"][name]


def _called(function: str) -> Callable[[Calls], Any]:
    return lambda calls: function in calls


gen, res = _job("run_generate"), _job("run_rescore")

GENERATE = {
    "model": Given(("--model", "m-dir"), lambda c: gen(c).model, Path("m-dir")),
    "prompts": Given(("--prompts", "p.jsonl"), lambda c: gen(c).prompts, Path("p.jsonl")),
    "out": Given(("--out", "run-dir"), lambda c: gen(c).out, Path("run-dir")),
    "engine": Given(("--engine", "vllm"), lambda c: gen(c).engine, "vllm"),
    "engine_arg": Given(
        ("--engine-arg", "retry_backoff_s=2.5"), lambda c: gen(c).config.engine_args["retry_backoff_s"], "2.5"
    ),
    "samples_per_prompt": Given(("--samples-per-prompt", "3"), lambda c: gen(c).samples_per_prompt, 3),
    "num_prompts": Given(("--num-prompts", "5"), lambda c: gen(c).num_prompts, 5),
    "temperature": Given(("--temperature", "0.7"), lambda c: gen(c).params.temperature, 0.7),
    "top_p": Given(("--top-p", "0.9"), lambda c: gen(c).params.top_p, 0.9),
    "top_k": Given(("--top-k", "11"), lambda c: gen(c).params.top_k, 11),
    "max_new_tokens": Given(("--max-new-tokens", "13"), lambda c: gen(c).params.max_new_tokens, 13),
    "logprobs_mode": Given(("--logprobs-mode", "processed"), lambda c: gen(c).params.logprobs_mode, "processed"),
    "seed": Given(("--seed", "17"), lambda c: gen(c).params.seed, 17),
    "batch_size": Given(("--batch-size", "19"), lambda c: gen(c).config.batch_size, 19),
    "dtype": Given(("--dtype", "fp16"), lambda c: gen(c).config.dtype, "fp16"),
    "server_url": Given(
        ("--server-url", "http://127.0.0.1:9"), lambda c: gen(c).config.engine_args["server_url"], "http://127.0.0.1:9"
    ),
    "concurrency": Given(("--concurrency", "23"), lambda c: gen(c).config.engine_args["concurrency"], "23"),
    "timeout": Given(("--timeout", "29.5"), lambda c: gen(c).config.engine_args["timeout_s"], "29.5"),
    "max_retries": Given(("--max-retries", "31"), lambda c: gen(c).config.engine_args["max_retries"], "31"),
    "resume": Given(("--resume",), lambda c: gen(c).resume, True),
    "overwrite": Given(("--overwrite",), lambda c: gen(c).overwrite, True),
    "trust_remote_code": Given(("--trust-remote-code",), lambda c: gen(c).trust_remote_code, True),
    "moe_family": Given(("--moe-family", "mixtral"), lambda c: gen(c).moe_family, "mixtral"),
}

RESCORE_MEGATRON = {
    "run": Given(("run-dir",), lambda c: res(c).run, Path("run-dir")),
    "engine": Given(("--engine", "megatron"), lambda c: res(c).engine, "megatron"),
    "model": Given(("--model", "m-dir"), lambda c: res(c).model, Path("m-dir")),
    "dtype": Given(("--dtype", "bf16"), lambda c: res(c).config.dtype, "bf16"),
    "replay": Given(("--replay", "r3"), lambda c: res(c).replay, "r3"),
    "repeats": Given(("--repeats", "3"), lambda c: res(c).repeats, 3),
    "vary_batching": Given(("--vary-batching",), lambda c: res(c).vary_batching, True),
    "name": Given(("--name", "custom"), lambda c: res(c).name, "custom"),
    "batch_size": Given(("--batch-size", "5"), lambda c: res(c).config.batch_size, 5),
    "logprob_chunk": Given(("--logprob-chunk", "7"), lambda c: res(c).config.engine_args["logprob_chunk"], "7"),
    "tensor_parallel": Given(("--tp", "2"), lambda c: res(c).config.engine_args["tensor_parallel"], "2"),
    "expert_parallel": Given(("--ep", "4"), lambda c: res(c).config.engine_args["expert_parallel"], "4"),
    "resume": Given(("--resume",), lambda c: res(c).resume, True),
    "overwrite": Given(("--overwrite",), lambda c: res(c).overwrite, True),
    "trust_remote_code": Given(("--trust-remote-code",), lambda c: res(c).trust_remote_code, True),
    "moe_family": Given(("--moe-family", "deepseek_v3"), lambda c: res(c).moe_family, "deepseek_v3"),
    "old": Given(("--old", "hf-fp32"), lambda c: res(c).old, "hf-fp32"),
    "policy_step": Given(("--policy-step", "4"), lambda c: res(c).policy_step, 4),
    "router_logprobs": Given(("--router-logprobs",), lambda c: res(c).router_logprobs, True),
    "sampling": Given(("--sampling", "rollout"), lambda c: res(c).sampling, "rollout"),
    "role": Given(("--role", "matched"), lambda c: res(c).role, "matched"),
}
# The megatron engine's options are all taken by the aliases above: --engine-arg gets its own command line.
RESCORE_HF = {
    "run": Given(("run-dir",), lambda c: res(c).run, Path("run-dir")),
    "engine_arg": Given(("--engine-arg", "logprob_chunk=9"), lambda c: res(c).config.engine_args["logprob_chunk"], "9"),
}

swp = _job("run_sweep")
SWEEP = {
    "run": Given(("run-dir",), lambda c: swp(c).run, Path("run-dir")),
    "engine": Given(("--engine", "megatron"), lambda c: swp(c).engine, "megatron"),
    "engine_arg": Given(
        ("--engine-arg", "tensor_parallel=2"), lambda c: swp(c).config.engine_args, {"tensor_parallel": "2"}
    ),
    "dtype": Given(("--dtype", "fp16"), lambda c: swp(c).config.dtype, "fp16"),
    "vary": Given(
        ("--vary", "logprob_chunk=64,128", "--vary", "both:dtype=fp32"),
        lambda c: swp(c).vary,
        ("logprob_chunk=64,128", "both:dtype=fp32"),
    ),
    "batch_size": Given(("--batch-size", "5"), lambda c: swp(c).config.batch_size, 5),
    "overwrite": Given(("--overwrite",), lambda c: swp(c).overwrite, True),
    "trust_remote_code": Given(("--trust-remote-code",), lambda c: swp(c).trust_remote_code, True),
    "moe_family": Given(("--moe-family", "deepseek_v3"), lambda c: swp(c).moe_family, "deepseek_v3"),
}

DEMO = {
    "out": Given(("--out", "d-dir"), _arg("run_demo", "out"), Path("d-dir")),
    "num_prompts": Given(("--num-prompts", "3"), _arg("run_demo", "num_prompts"), 3),
    "max_new_tokens": Given(("--max-new-tokens", "5"), _arg("run_demo", "max_new_tokens"), 5),
}

REPORT = {
    "run": Given(("run-dir",), _arg("build_report", "run_root"), Path("run-dir")),
    "pair": Given(("--pair", "rollout:scores/hf-bf16"), _arg("build_report", "pairs"), ["rollout:scores/hf-bf16"]),
    "thresholds": Given(("--thresholds", "3,4"), _option("thresholds"), ["3", "4"]),
    "routing_scope": Given(("--routing-scope", "response"), _option("routing_scope"), "response"),
    "tis_caps": Given(("--tis-caps", "3"), _option("tis_caps"), ["3"]),
    "geo_bounds": Given(("--geo-bounds", "1.5"), _option("geo_bounds"), ["1.5"]),
    "worst": Given(("--worst", "7"), lambda c: (_option("worst")(c), "print_worst" in c), (7, True)),
    "workers": Given(("--workers", "3"), _arg("build_report", "workers"), 3),
    "ray": Given(("--ray", "ray://head:10001"), _arg("build_report", "ray"), "ray://head:10001"),
    "bands": Given(("--bands", "gate.toml"), _arg("build_report", "bands_file"), Path("gate.toml")),
    "drift_ratio": Given(("--drift-ratio", "2"), _option("drift_ratio"), 2.0),
    "ppo_bounds": Given(("--ppo-bounds", "above@1.3,below@0.7"), _option("ppo_bounds"), ["above@1.3", "below@0.7"]),
}

GATE = {
    "run": Given(("run-dir",), _arg("evaluate", "run_root"), Path("run-dir")),
    "max_": Given(("--max", "k3_kl=0.1"), _arg("parse_limits", "max_args"), ["k3_kl=0.1"]),
    "config": Given(("--config", "limits.toml"), _arg("parse_limits", "config"), Path("limits.toml")),
    "pair": Given(("--pair", "a:b"), _arg("evaluate", "pairs"), ["a:b"]),
    "as_json": Given(("--json",), lambda c: ("checks_json" in c, "print_checks" in c), (True, False)),
    "junit": Given(("--junit", "j.xml"), _arg("write_junit", "path"), Path("j.xml")),
    "use_ci_upper": Given(("--use-ci-upper",), _arg("evaluate", "use_ci_upper"), True),
    "strict": Given(("--strict",), _arg("evaluate", "strict"), True),
    "allow": Given(
        ("--allow", "greedy", "--allow", "off_by_one"), _arg("gate_findings", "allow"), ["greedy", "off_by_one"]
    ),
    "baseline": Given(
        ("--baseline", "base-dir"),
        lambda c: (c["evaluate"]["baseline"], c["parse_limits"]["required"]),
        (Path("base-dir"), False),
    ),
    "max_drift": Given(
        ("--max-drift", "2"),
        lambda c: (c["evaluate"]["max_drift"], c["parse_limits"]["required"]),
        (2.0, False),
    ),
    "history": Given(
        ("--history", "h1", "--history", "h2"),
        lambda c: (c["evaluate"]["history"], c["parse_limits"]["required"]),
        ([Path("h1"), Path("h2")], False),
    ),
}

DOCTOR = {
    "run": Given(("run-dir",), _arg("run_checks", "run_path"), Path("run-dir")),
    "as_json": Given(("--json",), lambda c: ("findings_json" in c, "print_findings" in c), (True, False)),
}

COMPARE = {
    "runs": Given(("r1", "r2"), _arg("compare_runs", "roots"), [Path("r1"), Path("r2")]),
    "keys": Given(("--keys", "k3_kl,is_ess"), _arg("compare_runs", "keys"), ["k3_kl", "is_ess"]),
    "out": Given(("--out", "cmp-dir"), _arg("compare_runs", "out"), Path("cmp-dir")),
}

loc = _job("run_locate")
LOCATE = {
    "run": Given(("run-dir",), lambda c: loc(c).run, Path("run-dir")),
    "a": Given(("--a", "hf:fp32"), lambda c: loc(c).a, "hf:fp32"),
    "b": Given(("--b", "hf:bf16:attn_implementation=eager"), lambda c: loc(c).b, "hf:bf16:attn_implementation=eager"),
    "worst": Given(("--worst", "7"), lambda c: loc(c).worst, 7),
    "samples": Given(("--samples", "3"), lambda c: loc(c).samples, 3),
    "batch_size": Given(("--batch-size", "2"), lambda c: loc(c).batch_size, 2),
    "as_json": Given(("--json",), lambda c: (loc(c).quiet, "json_text" in c, "print_result" in c), (True, True, False)),
}

imp = _job("run_import")
IMPORT = {
    "format": Given(("prime-rl",), lambda c: imp(c).format, DumpFormat.prime_rl),
    "path": Given(("dump-dir",), lambda c: imp(c).path, Path("dump-dir")),
    "out": Given(("--out", "run-dir"), lambda c: imp(c).out, Path("run-dir")),
    "model": Given(("--model", "m-dir"), lambda c: imp(c).model, Path("m-dir")),
    "temperature": Given(("--temperature", "0.7"), lambda c: imp(c).temperature, 0.7),
    "overwrite": Given(("--overwrite",), lambda c: imp(c).overwrite, True),
    "trust_pickle": Given(("--trust-pickle",), lambda c: imp(c).trust_pickle, True),
}

dg = _job("run_diagnose")
DIAGNOSE_RUN = {
    "run": Given(("run-dir",), lambda c: dg(c).run, Path("run-dir")),
    "model": Given(("--model", "m-dir"), lambda c: dg(c).model, Path("m-dir")),
    "train_engine": Given(("--train-engine", "megatron"), lambda c: dg(c).train_engine, "megatron"),
    "train_arg": Given(("--train-arg", "device=cpu"), lambda c: dg(c).train_args, {"device": "cpu"}),
    "dtype": Given(("--dtype", "fp32"), lambda c: dg(c).dtype, "fp32"),
    "budget": Given(("--budget", "20m"), lambda c: dg(c).budget_s, 1200.0),
    "dry_run": Given(("--dry-run",), lambda c: dg(c).dry_run, True),
    "as_json": Given(("--json",), lambda c: (dg(c).as_json, "json_text" in c, "print_plan" in c), (True, True, False)),
    "batch_size": Given(("--batch-size", "3"), lambda c: dg(c).batch_size, 3),
    "trust_remote_code": Given(("--trust-remote-code",), lambda c: dg(c).trust_remote_code, True),
    "moe_family": Given(("--moe-family", "qwen3_moe"), lambda c: dg(c).moe_family, "qwen3_moe"),
}
dgen = lambda c: dg(c).generate  # noqa: E731
DIAGNOSE_GENERATE = {
    "out": Given(("--out", "run-dir"), lambda c: (dg(c).run, dgen(c).out), (Path("run-dir"),) * 2),
    "prompts": Given(("--prompts", "p.jsonl"), lambda c: dgen(c).prompts, Path("p.jsonl")),
    "model": Given(("--model", "m-dir"), lambda c: (dg(c).model, dgen(c).model), (Path("m-dir"),) * 2),
    "engine": Given(("--engine", "vllm"), lambda c: dgen(c).engine, "vllm"),
    "engine_arg": Given(
        ("--engine-arg", "retry_backoff_s=2.5"), lambda c: dgen(c).config.engine_args["retry_backoff_s"], "2.5"
    ),
    "samples_per_prompt": Given(("--samples-per-prompt", "3"), lambda c: dgen(c).samples_per_prompt, 3),
    "num_prompts": Given(("--num-prompts", "5"), lambda c: dgen(c).num_prompts, 5),
    "temperature": Given(("--temperature", "0.7"), lambda c: dgen(c).params.temperature, 0.7),
    "top_p": Given(("--top-p", "0.9"), lambda c: dgen(c).params.top_p, 0.9),
    "top_k": Given(("--top-k", "20"), lambda c: dgen(c).params.top_k, 20),
    "max_new_tokens": Given(("--max-new-tokens", "9"), lambda c: dgen(c).params.max_new_tokens, 9),
    "logprobs_mode": Given(("--logprobs-mode", "processed"), lambda c: dgen(c).params.logprobs_mode, "processed"),
    "seed": Given(("--seed", "4"), lambda c: dgen(c).params.seed, 4),
    "dtype": Given(("--dtype", "fp16"), lambda c: (dg(c).dtype, dgen(c).config.dtype), ("fp16", "fp16")),
    "batch_size": Given(("--batch-size", "3"), lambda c: (dg(c).batch_size, dgen(c).config.batch_size), (3, 3)),
    "trust_remote_code": Given(("--trust-remote-code",), lambda c: dgen(c).trust_remote_code, True),
    "moe_family": Given(("--moe-family", "qwen3_moe"), lambda c: dgen(c).moe_family, "qwen3_moe"),
}

ENV = {"as_json": Given(("--json",), lambda c: ("collect" in c, "print_environment" in c), (True, False))}
ENV_RUN = {
    "run": Given(("run-dir",), lambda c: (c["run_setup"]["root"], c["print_run_setup"]["root"]), (Path("run-dir"),) * 2)
}
FOUND = Environment(probe="0", python="3", platform="p", packages={}, cuda=None)

CASES = {
    "generate": Case({"mismatch_probe.pipeline.generate:run_generate": None}, (GENERATE,)),
    "rescore": Case({"mismatch_probe.pipeline.rescore:run_rescore": None}, (RESCORE_MEGATRON, RESCORE_HF)),
    "sweep": Case({"mismatch_probe.pipeline.sweep.run:run_sweep": None}, (SWEEP,)),
    "demo": Case({"mismatch_probe.pipeline.demo.run:run_demo": None}, (DEMO,)),
    "import": Case({"mismatch_probe.importers.job:run_import": ImportResult(samples=0, tokens=0, lacks=[])}, (IMPORT,)),
    "report": Case(
        {
            "mismatch_probe.report.build:build_report": Report(directory=Path("report"), metrics={}),
            "mismatch_probe.report.render.terminal.summary:print_summary": None,
            "mismatch_probe.report.render.terminal.worst:print_worst": None,
        },
        (REPORT,),
    ),
    "gate": Case(
        {
            "mismatch_probe.gate.check:parse_limits": {},
            "mismatch_probe.gate.check:evaluate": [],
            "mismatch_probe.gate.check:write_junit": None,
            "mismatch_probe.gate.check:checks_json": "[]",
            "mismatch_probe.gate.show:print_checks": None,
            "mismatch_probe.gate.findings:gate_findings": [],
            "mismatch_probe.gate.show:print_findings": None,
        },
        (GATE,),
    ),
    "doctor": Case(
        {
            "mismatch_probe.doctor.run:run_checks": [],
            "mismatch_probe.doctor.show:findings_json": "{}",
            "mismatch_probe.doctor.show:print_findings": None,
        },
        (DOCTOR,),
    ),
    "locate": Case(
        {
            "mismatch_probe.locate.job:run_locate": SimpleNamespace(exit_code=0),
            "mismatch_probe.locate.show:json_text": "{}",
            "mismatch_probe.locate.show:print_result": None,
        },
        (LOCATE,),
    ),
    "compare": Case(
        {"mismatch_probe.compare.runs:compare_runs": None, "mismatch_probe.compare.runs:print_compare": None},
        (COMPARE,),
    ),
    "env": Case(
        {
            "mismatch_probe.environment:collect": FOUND,
            "mismatch_probe.environment:print_environment": None,
            "mismatch_probe.environment:run_setup": [],
            "mismatch_probe.environment:print_run_setup": None,
        },
        (ENV, ENV_RUN),
    ),
    "diagnose": Case(
        {
            "mismatch_probe.pipeline.diagnose.run:run_diagnose": SimpleNamespace(exit_code=0),
            "mismatch_probe.pipeline.diagnose.summary:json_text": "{}",
            "mismatch_probe.pipeline.diagnose.summary:print_plan": None,
            "mismatch_probe.pipeline.diagnose.summary:print_screen": None,
        },
        (DIAGNOSE_RUN, DIAGNOSE_GENERATE),
    ),
    "keys": Case(
        {"mismatch_probe.report.render.terminal.keys:print_keys": None},
        ({"format": Given(("--format", "json"), _arg("print_keys", "format"), "json")},),
    ),
}

# Options that configure no work, and so reach no job.
HELP_ONLY = {("generate", "help_engine"), ("rescore", "help_engine"), ("sweep", "help_engine")}

COMMANDS: dict[str, click.Command] = typer.main.get_command(app).commands


def _options(command: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in COMMANDS[command].params if (command, p.name) not in HELP_ONLY}


def _record(monkeypatch, patched: dict[str, Any]) -> Calls:
    calls: Calls = {}
    for target, result in patched.items():
        module_name, name = target.split(":")
        module = importlib.import_module(module_name)
        signature = inspect.signature(getattr(module, name))

        def recorder(*args, _name=name, _signature=signature, _result=result, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            bound.apply_defaults()
            calls[_name] = dict(bound.arguments)
            return _result

        monkeypatch.setattr(module, name, recorder)
    return calls


def test_every_command_has_a_case():
    assert sorted(COMMANDS) == sorted(CASES)


@pytest.mark.parametrize("command", sorted(CASES))
def test_every_option_has_a_non_default_test_value(command):
    options = _options(command)
    given = {name: g for scenario in CASES[command].scenarios for name, g in scenario.items()}
    assert [f"option {options[n].opts[0]} of {command} has no test value" for n in options if n not in given] == []
    assert [f"test value for '{n}', which {command} lacks" for n in given if n not in options] == []
    assert [
        f"{options[n].opts[0]} of {command}: the test value is the default"
        for n, g in given.items()
        if g.expected == options[n].default
    ] == []


@pytest.mark.parametrize("command", sorted(CASES))
def test_every_option_reaches_its_work(command, monkeypatch):
    calls = _record(monkeypatch, CASES[command].patched)
    for scenario in CASES[command].scenarios:
        calls.clear()
        argv = [command] + [token for given in scenario.values() for token in given.argv]
        result = runner.invoke(app, argv, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        arrived = {name: given.arrived(calls) for name, given in scenario.items()}
        assert arrived == {name: given.expected for name, given in scenario.items()}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _as_fields(command: str) -> set[str]:
    """The job fields the command's options should fill: each option's own name, except the engine's
    options (--engine-arg and the flags that alias one engine arg), which all land in `engine_args`."""
    return {
        "engine_args" if name == "engine_arg" or set(p.opts) & set(ALIASES) else name
        for name, p in _options(command).items()
    }


def test_generate_job_fields_are_the_command_options():
    job = _fields(GenerateJob) - {"params", "config"} | _fields(SamplingParams) | _fields(EngineConfig)
    assert _as_fields("generate") == job


def test_import_job_fields_are_the_command_options():
    assert _as_fields("import") == _fields(ImportJob)


def test_rescore_job_fields_are_the_command_options():
    job = _fields(RescoreJob) - {"config"} | _fields(EngineConfig)
    assert _as_fields("rescore") == job


def test_sweep_job_fields_are_the_command_options():
    job = _fields(SweepJob) - {"config"} | _fields(EngineConfig)
    assert _as_fields("sweep") == job
