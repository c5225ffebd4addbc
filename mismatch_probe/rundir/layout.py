"""The run directory (SPEC section 3): manifest.json, rollout/, scores/NAME/, report/, and the sides of a run.

A side is `rollout` or `scores/NAME` (a bare NAME is accepted wherever the user names one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.location import run_path
from mismatch_probe.rundir.manifests import RUNNING, RolloutManifest, ScoreManifest
from mismatch_probe.rundir.ownership import Entry, Layout, accepted_by, clear, json_with, named_files, refuse_foreign
from mismatch_probe.rundir.parts import part_files, remove_unfinished
from mismatch_probe.rundir.roles import recorded_role
from mismatch_probe.rundir.sweep import SWEEP_FILE
from mismatch_probe.vocab import DTYPE_ALIASES, ENGINE_PREFILL, NO_REPLAY, Replay

ROLLOUT = "rollout"
SCORES = "scores"
REPORT = "report"
MANIFEST = "manifest.json"
METRICS_FILE = "metrics.json"
INFERENCE, TRAINING = "inference", "training"
PREFILL = "prefill"  # the inference engine's own prefill of the rollout (a score set of kind engine-prefill)
# The report's figures (plots.py names them); any other file in report/ is the user's.
REPORT_FIGURES = (
    "extreme_fraction.png",
    "routing_*.png",
    "scatter_*__*.png",
    "breakdown_*__*.png",
    "forensics_*__*.png",
)
# What probe writes in a run, and so what --overwrite may delete (see ownership.py).
_SCRATCH = named_files(".write-test", f".{MANIFEST}.tmp")
_PARTS = named_files("part-*.parquet", ".part-*.parquet.tmp")
REPORT_LAYOUT = Layout(
    what="a probe report folder",
    entries=(
        Entry(pattern=METRICS_FILE, check=json_with("schema_version", "comparisons")),
        *named_files(f".{METRICS_FILE}.tmp", "index.html", ".index.html.tmp", ".write-test", *REPORT_FIGURES),
    ),
)
LOCATE = "locate"  # `probe locate`'s page
LOCATE_SPILL = ".side-a"  # locate's side-a records while side b runs (locate/spill.py), removed after
LOCATE_LAYOUT = Layout(
    what="a probe locate folder",
    entries=(
        *named_files("index.html", ".index.html.tmp"),
        Entry(pattern=LOCATE_SPILL, layout=Layout(what="probe locate's side-a records", entries=named_files("*.pt"))),
    ),
)
DIAGNOSE, PLAN_FILE = "diagnose", "plan.json"  # `probe diagnose`'s plan
DIAGNOSE_LAYOUT = Layout(what="a probe diagnose folder", entries=named_files(PLAN_FILE, f".{PLAN_FILE}.tmp"))
SCORE_LAYOUT = Layout(
    what="a probe score set",
    entries=(Entry(pattern=MANIFEST, check=accepted_by(ScoreManifest.load)), *_SCRATCH, *_PARTS),
    marker=MANIFEST,
)
RUN_LAYOUT = Layout(
    what="a probe run",
    entries=(
        Entry(pattern=MANIFEST, check=accepted_by(RolloutManifest.load)),
        *_SCRATCH,
        Entry(pattern=ROLLOUT, layout=Layout(what="a probe rollout", entries=_PARTS)),
        Entry(
            pattern=SCORES, layout=Layout(what="probe score sets", entries=(Entry(pattern="*", layout=SCORE_LAYOUT),))
        ),
        Entry(pattern=REPORT, layout=REPORT_LAYOUT),
        Entry(pattern=LOCATE, layout=LOCATE_LAYOUT),
        Entry(pattern=DIAGNOSE, layout=DIAGNOSE_LAYOUT),
        Entry(pattern=SWEEP_FILE, check=json_with("base", "variants")),
        *named_files(f".{SWEEP_FILE}.tmp"),
    ),
    marker=MANIFEST,
)


@dataclass(frozen=True)
class SideInfo:
    """What produced one side, as attribution groups sides: engine and role, dtype, replay, pass."""

    side: str
    role: str  # inference (the rollout) or training (a score set)
    engine: str
    dtype: str | None
    replay: Replay = NO_REPLAY
    repeat_group: str | None = None
    pass_index: int | None = None
    complete: bool = True
    policy: tuple | None = None  # a new policy's pass: (its step, its weights); None for the rollout's checkpoint
    score_role: str | None = None  # a score set's role (rundir/roles.py): matched, a diagnostic role, or None (plain)

    @property
    def setup(self) -> tuple:
        """Sides with equal setups differ only by pass: one of them stands for all (see `Run.canonical`). A new
        policy's pass is a setup of its own: it never stands for the rollout's checkpoint."""
        return (self.role, self.engine, self.dtype, self.replay, self.policy)

    @property
    def rank(self) -> tuple:
        return (self.repeat_group is not None, self.pass_index or 0, self.side)


def default_score_name(
    engine: str, dtype: str, replay: str, policy_step: int | None = None, old: str | None = None
) -> str:
    """The name `probe rescore` gives a score set without --name: ENGINE-DTYPE[-r2|-r3], and for a new policy's
    pass -stepN (or -new without --policy-step)."""
    name = f"{engine}-{dtype}" + (f"-{replay}" if replay != NO_REPLAY else "")
    if old is None:
        return name
    return name + (f"-step{policy_step}" if policy_step is not None else "-new")


def pass_names(base: str, repeats: int) -> list[str]:
    """The score sets of `--repeats N`: BASE alone, or BASE-pass1..N."""
    return [base] if repeats == 1 else [f"{base}-pass{i}" for i in range(1, repeats + 1)]


def canonical_dtype(dtype) -> str | None:
    if not isinstance(dtype, str) or dtype in ("", "unknown", "auto"):
        return None
    return DTYPE_ALIASES.get(dtype.lower(), dtype.lower())


@dataclass
class Run:
    root: Path
    manifest_path: Path = field(init=False)
    rollout_dir: Path = field(init=False)
    report_dir: Path = field(init=False)
    metrics_path: Path = field(init=False)

    def __post_init__(self):
        self.root = run_path(self.root)  # a local folder, or a URL (s3://...)
        self.manifest_path = self.root / MANIFEST
        self.rollout_dir = self.root / ROLLOUT
        self.report_dir = self.root / REPORT
        self.metrics_path = self.report_dir / METRICS_FILE

    def score_dir(self, name: str) -> Path:
        return self.root / SCORES / name

    def manifest(self) -> RolloutManifest:
        """The rollout manifest, checked to be one this version can read."""
        if not self.root.is_dir():
            raise ProbeError(f"{self.root}: run directory not found")
        manifest = RolloutManifest.load(self.manifest_path)
        manifest.check_compatible(self.manifest_path)
        return manifest

    def score_manifest(self, name: str) -> ScoreManifest:
        return ScoreManifest.load(self.score_dir(name) / MANIFEST)

    def score_sets(self) -> list[str]:
        scores = self.root / SCORES
        if not scores.is_dir():
            return []
        return sorted(p.name for p in scores.iterdir() if (p / MANIFEST).is_file())

    def side_dir(self, side: str) -> Path:
        if side == ROLLOUT:
            return self.rollout_dir
        return self.score_dir(side.removeprefix(f"{SCORES}/"))

    def side_name(self, name: str) -> str:
        """Canonical side name: `rollout` or `scores/NAME`; an unknown side lists the known ones."""
        name = name.strip().rstrip("/")
        if name == ROLLOUT:
            return ROLLOUT
        bare = name.removeprefix(f"{SCORES}/")
        if bare not in self.score_sets():
            known = ", ".join([ROLLOUT] + [f"{SCORES}/{s}" for s in self.score_sets()])
            raise ProbeError(f"{self.root / SCORES / bare}: no such side (known sides: {known})")
        return f"{SCORES}/{bare}"

    def parse_pair(self, text: str) -> tuple[str, str]:
        """`REFERENCE:CANDIDATE` as given to --pair."""
        reference, sep, candidate = text.partition(":")
        if not sep or not reference or not candidate:
            raise ProbeError(f"--pair {text!r}: expected REFERENCE:CANDIDATE, e.g. rollout:scores/hf-bf16")
        return self.side_name(reference), self.side_name(candidate)

    def default_pairs(self) -> list[tuple[str, str]]:
        """Rollout against every score set of the rollout's checkpoint, then pass i against pass i+1 within each
        repeat group, then each new policy's pass against its θ_old set (a policy comparison, not an engine's)."""
        names = self.score_sets()
        scores = self.root / SCORES
        for folder in sorted(scores.iterdir()) if scores.is_dir() else []:
            if folder.name not in names and part_files(folder):
                raise ProbeError(
                    f"{folder / MANIFEST}: file not found (score set '{folder.name}' has part files but no manifest)"
                )
        manifests = {name: self.score_manifest(name) for name in names}
        pairs = [(ROLLOUT, f"{SCORES}/{name}") for name in names if not manifests[name].is_new_policy]
        groups: dict[str, list[tuple[int, str]]] = {}
        for name in names:
            manifest = manifests[name]
            if manifest.repeat_group:
                groups.setdefault(manifest.repeat_group, []).append((manifest.pass_index or 0, name))
        for members in groups.values():
            members.sort()
            pairs += [(f"{SCORES}/{a}", f"{SCORES}/{b}") for (_, a), (_, b) in zip(members, members[1:])]
        for name, manifest in manifests.items():
            old = manifest.policy.get("old") if manifest.is_new_policy else None
            if old in manifests:
                pairs.append((f"{SCORES}/{old}", f"{SCORES}/{name}"))
        prefills = [name for name, m in manifests.items() if m.kind == ENGINE_PREFILL]
        trainers = [name for name, m in manifests.items() if m.kind != ENGINE_PREFILL and not m.is_new_policy]
        pairs += [(f"{SCORES}/{p}", f"{SCORES}/{t}") for p in prefills for t in trainers]  # for decode_share
        return pairs

    def side_info(self, side: str) -> SideInfo:
        if side == ROLLOUT:
            m = self.manifest()
            return SideInfo(
                side=ROLLOUT, role=INFERENCE, engine=m.engine_name or "unknown", dtype=canonical_dtype(m.dtype)
            )
        m = ScoreManifest.load(self.side_dir(side) / MANIFEST)
        return SideInfo(
            side=side,
            role=PREFILL if m.kind == ENGINE_PREFILL else TRAINING,
            engine=m.engine_name or "unknown",
            dtype=canonical_dtype(m.dtype),
            replay=m.replay or NO_REPLAY,
            repeat_group=m.repeat_group,
            pass_index=m.pass_index,
            complete=m.status != RUNNING,
            policy=(m.policy.get("step"), m.weights_sha256 or m.model) if m.is_new_policy else None,
            score_role=recorded_role(m, side.removeprefix(f"{SCORES}/")),
        )

    def side_infos(self) -> dict[str, SideInfo]:
        """The rollout and every score set."""
        sides = [ROLLOUT] + [f"{SCORES}/{name}" for name in self.score_sets()]
        return {side: self.side_info(side) for side in sides}

    def check_sides(self, rollout: RolloutManifest, sides: list[str]) -> None:
        """Every side finished; every score set scored the rollout's model at the rollout's temperature."""
        rollout.check_finished(self.manifest_path)
        for side in sides:
            if side == ROLLOUT:
                continue
            path = self.side_dir(side) / MANIFEST
            score = ScoreManifest.load(path)
            score.check_finished(path, self.root)
            score.check_scores(rollout, path)


def check_output(
    directory: Path, resume: bool, overwrite: bool, what: str, layout: Layout, resumable: bool = True
) -> None:
    """Whether `directory` may be written: a non-empty one needs --resume (keep finished parts) or
    --overwrite, which replaces only what probe wrote (`layout`). A writer that cannot resume (an import,
    the Recorder) is not `resumable`: its refusal offers no --resume."""
    if resume and overwrite:
        raise ProbeError("--resume and --overwrite exclude each other")
    if directory.exists() and not directory.is_dir():
        raise ProbeError(f"{directory}: exists and is not a directory")
    populated = directory.is_dir() and any(directory.iterdir())
    if populated and overwrite:
        refuse_foreign(directory, layout)
    elif populated and not resumable:
        raise ProbeError(f"{directory}: not empty (expected an absent or empty folder; overwrite replaces {what})")
    elif populated and not resume:
        raise ProbeError(
            f"{directory}: {what} already exists; pass --resume to continue it or --overwrite to replace it"
        )
    elif resume and not populated:
        raise ProbeError(f"{directory}: nothing to resume ({what} not found)")


def prepare_output(
    directory: Path, resume: bool, overwrite: bool, what: str, layout: Layout, resumable: bool = True
) -> None:
    """Make `directory` ready to write (see `check_output`)."""
    check_output(directory, resume, overwrite, what, layout, resumable)
    if overwrite and directory.is_dir():
        clear(directory, layout)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ProbeError(f"{directory}: output directory is not writable ({exc.strerror})") from exc
    remove_unfinished(directory)


@contextmanager
def removed_unless_written(run: Run, created: bool) -> Iterator[None]:
    """A generate that fails before any sample is written leaves nothing behind, so a retry needs no
    --overwrite: what it wrote goes, and the run folder too if this generate `created` it. A folder that
    holds anything else (a file the user put there meanwhile) is left as it is."""
    try:
        yield
    except BaseException:
        if not part_files(run.rollout_dir):
            with suppress(ProbeError, OSError):
                clear(run.root, RUN_LAYOUT)
                if created:
                    run.root.rmdir()
        raise
