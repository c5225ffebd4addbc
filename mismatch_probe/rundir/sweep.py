"""RUN/sweep.json: what `probe sweep` measured on a run, read by the report's "Measured remedies".

A sweep scores the run's tokens under a base training configuration and under variants, each changing one
knob (`--vary KNOB=V1,V2`, one variant per value):

- a `training` variant is a score set of RUN itself (the same tokens as the base: its comparison is paired);
- a `rollout` variant is a sibling run, a new rollout of the same prompts with the same seeds and the knob
  applied to the inference engine, scored with the base training configuration;
- a `both` variant is a sibling run as for `rollout`, scored with the knob applied on the training side too.
The tokens of a sibling run differ from RUN's, so those comparisons are unpaired.

Every path is relative to RUN's root ("." is RUN), so a run folder moved with its siblings keeps its sweep.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.jsonfile import read_json, write_json_atomic
from mismatch_probe.rundir.location import is_remote, run_path

SWEEP_FILE = "sweep.json"
TRAINING_SIDE, ROLLOUT_SIDE, BOTH_SIDES = "training", "rollout", "both"
SWEEP_SIDES = (TRAINING_SIDE, ROLLOUT_SIDE, BOTH_SIDES)
THIS_RUN = "."


@dataclass(frozen=True, kw_only=True)
class SweepVariant:
    """One variant: which side it changed, how, and where its score set is."""

    variant: str  # its name, as the report shows it: the score set (training) or the sibling run's folder name
    side: str  # training, rollout or both
    changed: dict  # knob -> value, as given to --vary (e.g. {"lm_head_dtype": "fp32"})
    run: str = THIS_RUN  # the run holding the variant's rollout, relative to RUN's root
    score_set: str  # the score set in `run` compared against that run's rollout

    def __post_init__(self) -> None:
        if self.side not in SWEEP_SIDES:
            raise ValueError(f"side {self.side!r} is not one of {', '.join(SWEEP_SIDES)}")

    @property
    def paired(self) -> bool:
        """Scored on RUN's own tokens: compared with the base sequence by sequence."""
        return self.run == THIS_RUN


@dataclass(frozen=True, kw_only=True)
class SweepFile:
    """The base configuration and the variants measured against it."""

    engine: str  # the training engine of the base
    dtype: str  # the base's training dtype
    engine_args: dict  # the base's --engine-arg values
    base: str  # the base's score set in RUN
    variants: list[SweepVariant] = field(default_factory=list)

    def save(self, run_root: Path) -> None:
        write_json_atomic(run_path(run_root) / SWEEP_FILE, asdict(self))

    @classmethod
    def load(cls, run_root: Path) -> SweepFile | None:
        """RUN's sweep, or None when the run has none."""
        path = run_path(run_root) / SWEEP_FILE  # a run at a URL included
        if not path.is_file():
            return None
        obj = read_json(path)
        try:
            variants = [SweepVariant(**v) for v in obj.get("variants", [])]
            return cls(
                engine=obj["engine"],
                dtype=obj["dtype"],
                engine_args=obj.get("engine_args") or {},
                base=obj["base"],
                variants=variants,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProbeError(f"{path}: not a sweep file written by `probe sweep` ({exc})") from exc

    def run_of(self, run_root: Path, variant: SweepVariant) -> Path:
        root = run_path(run_root)
        if variant.paired:
            return root
        if is_remote(root):  # an object store has no "..": the sibling's key is the run's parent's, by name
            return root.parent / Path(variant.run).name
        return (root / variant.run).resolve()
