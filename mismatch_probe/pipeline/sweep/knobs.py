"""`--vary [SIDE:]KNOB=V1,V2`: the knobs a sweep changes, checked against the engines before any work.

A knob is `dtype` or an `--engine-arg` key of the engine on its side: the training engine for `training`
(the default side), the rollout's inference engine for `rollout`, both for `both`. A key the options
dataclass does not name but that holds a dot (megatron's `override_transformer_config.FIELD`) is passed to
the engine, whose own check accepts or refuses it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mismatch_probe.engines import check_engine_args, engine_class, resolved_options
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.sweep import BOTH_SIDES, ROLLOUT_SIDE, SWEEP_SIDES, TRAINING_SIDE
from mismatch_probe.vocab import DTYPES

DTYPE_KNOB = "dtype"
VARY_FORM = "[rollout:|both:]KNOB=V1[,V2...], e.g. lm_head_dtype=fp32 or both:dtype=fp32"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what a folder name keeps of a value


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One variant: one knob set to one value on one side."""

    side: str
    key: str
    value: str

    @property
    def changed(self) -> dict:
        return {self.key: self.value}

    @property
    def spelled(self) -> str:
        """As --vary spells it: SIDE:KNOB=VALUE, the training side's without its prefix."""
        side = "" if self.side == TRAINING_SIDE else f"{self.side}:"
        return f"{side}{self.key}={self.value}"

    @property
    def label(self) -> str:
        """KNOB-VALUE as score-set and run names spell it: only letters, digits and . _ - survive."""
        return f"{self.key}-{_UNSAFE.sub('_', self.value)}"

    @property
    def trains(self) -> bool:
        """The training side takes the knob."""
        return self.side in (TRAINING_SIDE, BOTH_SIDES)

    @property
    def rolls_out(self) -> bool:
        """The variant needs a new rollout (a sibling run)."""
        return self.side in (ROLLOUT_SIDE, BOTH_SIDES)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """An engine configuration: its dtype and `--engine-arg` values."""

    dtype: str
    engine_args: dict

    def with_knob(self, knob: Knob) -> Setting:
        if knob.key == DTYPE_KNOB:
            return Setting(dtype=knob.value, engine_args=dict(self.engine_args))
        return Setting(dtype=self.dtype, engine_args={**self.engine_args, knob.key: knob.value})

    def resolved(self, kind: str, engine: str) -> tuple[str, dict]:
        """(dtype, every option resolved): equal for two settings that compute alike however they were spelled."""
        return self.dtype, resolved_options(kind, engine, self.engine_args)


def parse_vary(items: list[str], training: str, inference: str | None) -> list[Knob]:
    """The knobs of every `--vary`, one per value, in the order given; `inference` is the rollout's engine (None
    when the run's manifest names none)."""
    if not items:
        raise ProbeError(f"--vary: give at least one knob to vary ({VARY_FORM})")
    knobs: list[Knob] = []
    for text in items:
        for knob in _parse_one(text):
            if knob in knobs:
                raise ProbeError(f"--vary {text}: {knob.spelled} is given twice")
            if knob.trains:
                check_knob(knob, "training", training)
            if knob.rolls_out:
                if inference != "hf":
                    raise ProbeError(
                        f"--vary {text}: rollout-side variants need an --engine hf rollout "
                        f"(this run's rollout engine is {inference or 'not recorded'})"
                    )
                check_knob(knob, "inference", inference)
            knobs.append(knob)
    return knobs


def _parse_one(text: str) -> list[Knob]:
    head, sep, values = text.partition("=")
    side, colon, key = head.strip().rpartition(":")
    side, key = (side.strip() if colon else TRAINING_SIDE), key.strip()
    parts = [v.strip() for v in values.split(",")]
    if not sep or not key or not all(parts):
        raise ProbeError(f"--vary '{text}': expected {VARY_FORM}")
    if side not in SWEEP_SIDES:
        raise ProbeError(f"--vary '{text}': side '{side}' is not one of {', '.join(SWEEP_SIDES)}")
    return [Knob(side=side, key=key, value=value) for value in dict.fromkeys(parts)]


def check_knob(knob: Knob, kind: str, engine: str) -> None:
    """The knob is `dtype` with a known dtype, or an option of the engine with a value its options accept."""
    where = f"--vary {knob.spelled}"
    if knob.key == DTYPE_KNOB:
        if knob.value not in DTYPES:
            raise ProbeError(f"{where}: expected one of {', '.join(DTYPES)}")
        return
    names = [f.name for f in dataclasses.fields(engine_class(kind, engine).Options)]
    if knob.key not in names and "." not in knob.key:
        raise ProbeError(
            f"{where}: unknown knob for the {engine} {kind} engine (knobs: {', '.join([DTYPE_KNOB, *names])})"
        )
    try:
        check_engine_args(kind, engine, knob.changed)
    except ProbeError as err:  # the options name it as an --engine-arg; here it was a --vary
        detail = str(err).split(": ", 1)[1] if str(err).startswith("--engine-arg ") else str(err)
        raise ProbeError(f"{where}: {detail}") from None
