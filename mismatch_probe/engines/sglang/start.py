"""Why an SGLang Engine did not start, in one line that names the engine-arg to change.

SGLang checks its settings while the Engine starts and raises plain Python errors; the probe knows a
few of them by their text (SGLang 0.5.23's wording) and says which `--engine-arg` to change. Any
other failure gives the error's last line, exit 1.
"""

from __future__ import annotations

import re

from mismatch_probe.errors import EngineFailure, ProbeError

# Settings that start an Engine without a GPU (SGLang's CPU build): the CPU attention backends are
# not among those its deterministic mode accepts.
CPU_SETTINGS = "--engine-arg attention_backend=torch_native --engine-arg enable_deterministic_inference=false"
# The ValueError of SGLang's deterministic-mode check (sglang/srt/arg_groups/overrides.py:1120 in 0.5.23).
DETERMINISTIC_BACKENDS = "attention backends are supported for deterministic inference"
# ServerArgs(**kwargs) with a setting this SGLang lacks: msgspec's and a dataclass's TypeError.
UNKNOWN_SETTING = re.compile(r"unexpected keyword argument '(\w+)'", re.IGNORECASE)
WHERE = "SGLang Engine did not start"


def last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def start_failure(exc: Exception, version: str | None) -> ProbeError:
    """The one-line error for `exc`, raised by `sglang.Engine(...)`: exit 2 for settings to change."""
    line = last_line(exc)
    if DETERMINISTIC_BACKENDS in line:
        return ProbeError(
            f"{WHERE}: {line} Set --engine-arg enable_deterministic_inference=false (SGLang then ignores "
            "sampling_seed) or --engine-arg attention_backend to one it names"
        )
    unknown = UNKNOWN_SETTING.search(line)
    if unknown:
        return ProbeError(
            f"{WHERE}: SGLang {version or '(unknown version)'} has no setting '{unknown[1]}'; the probe needs "
            "sglang>=0.5.7: pip install 'mismatch-probe[sglang]'"
        )
    return EngineFailure(f"{WHERE}: {type(exc).__name__}: {line} (--debug shows the traceback)")
