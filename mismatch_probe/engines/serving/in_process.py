"""What the in-process inference engines (`sglang-offline`, `vllm-offline`) share: the dtype
check, the import of their package only once it is known to be installed, and warnings."""

from __future__ import annotations

import logging
from importlib import import_module

from mismatch_probe.engines.base import InferenceEngine
from mismatch_probe.engines.extras import require_engine
from mismatch_probe.errors import ProbeError
from mismatch_probe.vocab import PACKAGE_DTYPES

log = logging.getLogger("mismatch_probe")


class InProcessEngine(InferenceEngine):
    """An inference engine whose package (`package`) runs in the probe's own process."""

    package: str
    dtypes: dict[str, str] = PACKAGE_DTYPES  # the probe's dtype name -> the package's

    def __init__(self, model, config):
        super().__init__(model, config)
        if config.dtype not in self.dtypes:
            raise ProbeError(f"--dtype {config.dtype}: --engine {self.name} runs {', '.join(self.dtypes)}")
        require_engine(self.name)  # exit 2 with the install command, not an ImportError
        self.module = import_module(self.package)
        self.warnings: list[str] = []
        self.settings = self.construction_kwargs()  # recorded in the manifest as given
        self.start()

    def start(self) -> None:
        """Build the package's engine from `self.settings`."""
        raise NotImplementedError

    def construction_kwargs(self) -> dict:
        """Keyword arguments of the package's engine class, from the options and the model."""
        raise NotImplementedError

    @property
    def package_dtype(self) -> str:
        return self.dtypes[self.config.dtype]

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning("warning: %s", message)
