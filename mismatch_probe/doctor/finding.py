"""A doctor finding: one setup bug the run's data points at, with its evidence, cause and fix.

The fixes name the probe flag and the config key of verl, slime and NeMo-RL where one exists (None where
the framework has no single key for it). They are the usual spellings of those frameworks' options; check
them against the version you run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FIX_KEYS = ("probe", "verl", "slime", "nemo_rl")


@dataclass(frozen=True)
class Fix:
    probe: str
    verl: str | None = None
    slime: str | None = None
    nemo_rl: str | None = None


@dataclass(frozen=True)
class Check:
    """What a check is about: its name, the usual cause of its finding and the fix."""

    name: str
    cause: str
    fix: Fix


@dataclass(frozen=True)
class Finding:
    check: str
    found: str  # what was found, with the numbers
    cause: str
    fix: dict[str, str | None]  # keys FIX_KEYS
    evidence: dict = field(default_factory=dict)  # the numbers, machine-readable

    @classmethod
    def of(cls, check: Check, found: str, evidence: dict) -> Finding:
        return cls(check=check.name, found=found, cause=check.cause, fix=asdict(check.fix), evidence=evidence)

    def to_json(self) -> dict:
        return asdict(self)
