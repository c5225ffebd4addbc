"""`probe env`: what this environment has, and which engines can run in it (for bug reports and the doctor).

The convention of `transformers env`, `accelerate env` and `python -m torch.utils.collect_env`: versions of
the packages that change probe's numbers, the accelerator, and for each engine yes or the one line why not.
Nothing here raises: a package that fails to import is reported as such.
"""

from __future__ import annotations

import platform
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from importlib import metadata, util

from mismatch_probe import __version__

PACKAGES = (
    "torch",
    "transformers",
    "pyarrow",
    "numpy",
    "polars",
    "typer",
    "rich",
    "accelerate",
    "megatron-core",
    "transformer-engine",
    "sglang",
    "vllm",
    "ray",
)
MEGATRON_TESTED = "0.16.1"  # the [megatron] extra's pin: the shims in engines/megatron/shims.py patch its code


@dataclass(frozen=True, kw_only=True)
class EngineStatus:
    kind: str  # inference or training
    name: str
    runs: bool
    why: str  # one line: how it runs here, or why it cannot


@dataclass(frozen=True, kw_only=True)
class Environment:
    probe: str
    python: str
    platform: str
    packages: dict[str, str | None]
    cuda: str | None  # the CUDA torch was built with
    gpus: list[str] = field(default_factory=list)
    engines: list[EngineStatus] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _torch() -> tuple[str | None, list[str], str | None]:
    """(CUDA version torch was built with, names of the visible GPUs, why torch is unusable or None)."""
    try:
        import torch
    except Exception as exc:  # a broken torch is what this command exists to show
        return None, [], f"torch does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return torch.version.cuda, gpus, None


def _imports(module: str) -> str | None:
    """None when `module` imports, else the one line why not."""
    try:
        with warnings.catch_warnings():  # megatron-core warns at import about every optional package it lacks
            warnings.simplefilter("ignore")
            __import__(module)
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{module} does not import ({type(exc).__name__}: {text})"
    return None


def _engines(packages: dict[str, str | None], gpus: list[str], torch_error: str | None) -> list[EngineStatus]:
    device = f"CUDA ({gpus[0]})" if gpus else "CPU"
    hf_why = torch_error or _imports("transformers")
    hf = (
        (False, hf_why)
        if hf_why
        else (True, f"transformers {packages['transformers']} on {device}{_older_than_families(packages)}")
    )
    http = "a client of a running server (HTTP); needs only the server's URL"
    rows = [
        ("inference", "hf", *hf),
        ("inference", "sglang", True, f"{http}: start SGLang with --enable-return-routed-experts"),
        ("inference", "vllm", True, f"{http}: start vLLM with --enable-return-routed-experts for routing"),
        ("inference", "sglang-offline", *_sglang_offline(packages, gpus)),
        ("inference", "vllm-offline", *_package_engine(packages, "vllm", "vllm", "pip install vllm")),
        ("training", "hf", *hf),
        ("training", "megatron", *_megatron(packages, device, torch_error)),
    ]
    return [EngineStatus(kind=kind, name=name, runs=runs, why=why) for kind, name, runs, why in rows]


def _older_than_families(packages: dict) -> str:
    """The MoE families whose routers this transformers is too old for (the hf engines refuse them)."""
    from mismatch_probe.model.moe.families import ADAPTERS

    if not packages["transformers"]:
        return ""
    installed = _release(packages["transformers"])
    needs: dict[str, list[str]] = {}
    for adapter in ADAPTERS:
        if adapter.min_transformers and installed < _release(adapter.min_transformers):
            needs.setdefault(adapter.min_transformers, []).append(adapter.family)
    return "".join(f"; {', '.join(families)}: need transformers >= {v}" for v, families in needs.items())


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, micro) of a version string such as 5.6.0 or 2.11.0+cu130."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _package_engine(packages: dict, dist: str, module: str, install: str) -> tuple[bool, str]:
    if packages[dist] is None:
        return False, f"{dist} is not installed ({install})"
    failed = _imports(module)
    return (False, failed) if failed else (True, f"{dist} {packages[dist]}")


def _sglang_offline(packages: dict, gpus: list[str]) -> tuple[bool, str]:
    if packages["sglang"] is None:
        return False, "sglang is not installed (pip install 'mismatch-probe[sglang]'); the HTTP engine needs none"
    if not gpus:
        return False, "SGLang's Engine needs a CUDA GPU; torch sees none"
    return True, f"sglang {packages['sglang']} on {gpus[0]}"


def _megatron(packages: dict, device: str, torch_error: str | None) -> tuple[bool, str]:
    version = packages["megatron-core"]
    if torch_error:
        return False, torch_error
    if version is None:
        return False, "megatron-core is not installed (pip install 'mismatch-probe[megatron]')"
    if version != MEGATRON_TESTED:
        return False, f"megatron-core {version} is installed; probe's shims are for {MEGATRON_TESTED} only"
    failed = _imports("megatron.core")
    if failed:
        return False, failed
    spec = "TransformerEngine" if util.find_spec("transformer_engine") and device != "CPU" else "local"
    return True, f"megatron-core {version} on {device}, {spec} layer spec"


def collect() -> Environment:
    packages = {name: installed(name) for name in PACKAGES}
    cuda, gpus, torch_error = _torch()
    return Environment(
        probe=__version__,
        python=f"{platform.python_version()} ({sys.executable})",
        platform=platform.platform(),
        packages=packages,
        cuda=cuda,
        gpus=gpus,
        engines=_engines(packages, gpus, torch_error),
    )


def print_environment(found: Environment) -> None:
    from rich.markup import escape
    from rich.table import Table

    from mismatch_probe.progress import stdout_console

    out = stdout_console()
    versions = Table(title="probe env", show_header=False, title_justify="left")
    versions.add_row("mismatch-probe", found.probe)
    versions.add_row("Python", escape(found.python))
    versions.add_row("platform", found.platform)
    versions.add_row("CUDA (torch built with)", found.cuda or "none (CPU build)")
    versions.add_row("GPUs", ", ".join(found.gpus) or "none visible to torch")
    for name, version in found.packages.items():
        versions.add_row(name, escape(version or "not installed"))
    out.print(versions)
    engines = Table(title="engines", title_justify="left")
    for column in ("kind", "engine", "runs here", "how / why not"):
        engines.add_column(column)
    for engine in found.engines:
        engines.add_row(engine.kind, engine.name, "yes" if engine.runs else "no", escape(engine.why))  # [sglang]
    out.print(engines)


@dataclass(frozen=True, kw_only=True)
class SideSetup:
    """What produced one side of a run, as `probe env RUN` shows it: its engine and dtype, its quantization and
    its sampling (the manifests' entries, and the report's one-line reading of them)."""

    side: str
    engine: str | None
    dtype: str | None
    quantization: dict | None
    sampling: dict | None
    setup: str
    # The rollout's: the hf training pass matched to its quantization (`--engine hf --engine-arg ...`), or why
    # none is known (quant/served.py); None for a score set and for a rollout not quantized.
    matched_pass: str | None = None


def run_setup(root) -> list[SideSetup]:
    """Every side of the run at `root`: the rollout, then each score set."""
    from mismatch_probe.report.verdict.production import productions
    from mismatch_probe.rundir.layout import ROLLOUT, SCORES, Run

    run = Run(root)
    manifests = {ROLLOUT: run.manifest()} | {f"{SCORES}/{name}": run.score_manifest(name) for name in run.score_sets()}
    prods = productions(run, list(manifests))
    matched = {ROLLOUT: _matched_pass(prods[ROLLOUT].quantization, manifests[ROLLOUT].model)}
    return [
        SideSetup(
            side=side,
            engine=m.engine_name,
            dtype=m.dtype,
            quantization=prods[side].quantization,
            sampling=prods[side].sampling,
            setup=prods[side].setup_line(),
            matched_pass=matched.get(side),
        )
        for side, m in manifests.items()
    ]


def _matched_pass(quantization: dict | None, model) -> str | None:
    from mismatch_probe.quant.served import engine_args_text, matched_quant_args, no_pass_reason

    if not isinstance(quantization, dict):
        return None
    args = matched_quant_args(quantization, model)
    return no_pass_reason(quantization) if args is None else f"--engine hf{engine_args_text(args)}"


def print_run_setup(root, sides: list[SideSetup]) -> None:
    from shlex import quote

    from rich.markup import escape
    from rich.table import Table

    from mismatch_probe.progress import stdout_console

    table = Table(title=f"run {escape(str(root))}", title_justify="left")
    for column in ("side", "engine", "dtype", "quantization; sampling"):
        table.add_column(column)
    for s in sides:
        table.add_row(escape(s.side), escape(s.engine or "unknown"), escape(s.dtype or "unknown"), escape(s.setup))
    stdout_console().print(table)
    for s in sides:
        if s.matched_pass is not None:  # the rollout's matched training pass, for `probe rescore RUN`
            line = (
                s.matched_pass
                if s.matched_pass.startswith("no ")
                else f"probe rescore {quote(str(root))} {s.matched_pass}"
            )
            stdout_console().print(escape(f"{s.side}: matched training pass: {line}"), soft_wrap=True)
