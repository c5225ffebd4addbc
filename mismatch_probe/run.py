"""The run directory (SPEC section 3): manifest, rollout/, scores/NAME/, report/."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from . import __version__
from .errors import ProbeError
from .schema import SCHEMA_VERSION, RoutingShape

ROLLOUT = "rollout"
SCORES = "scores"
REPORT = "report"
MANIFEST = "manifest.json"


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise ProbeError(f"{path}: cannot write ({exc.strerror})") from exc


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"{path}: file not found")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProbeError(f"{path}: not valid JSON ({exc})") from exc
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not isinstance(obj, dict):
        raise ProbeError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"mismatch-probe": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "megatron-core", "sglang", "vllm", "pyarrow"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def routing_shape(manifest: dict) -> RoutingShape:
    return RoutingShape(
        num_layers=int(manifest.get("num_layers", 0)),
        top_k=int(manifest.get("top_k", 0)),
        num_experts=int(manifest.get("num_experts", 0)),
    )


def check_routing_fields(manifest: dict, where: Path) -> None:
    """num_layers, top_k, num_experts: non-negative integers, and 1 <= top_k <= num_experts for an MoE model."""
    for key in ("num_layers", "top_k", "num_experts"):
        value = manifest.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProbeError(f"{where}: {key} is {value!r}, expected a non-negative integer")
    if manifest.get("num_layers", 0) and not 1 <= manifest.get("top_k", 0) <= manifest.get("num_experts", 0):
        raise ProbeError(
            f"{where}: top_k {manifest.get('top_k', 0)!r} and num_experts {manifest.get('num_experts', 0)!r} "
            "do not describe an MoE model (expected 1 <= top_k <= num_experts)"
        )


@dataclass(frozen=True)
class Run:
    root: Path

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    @property
    def rollout_dir(self) -> Path:
        return self.root / ROLLOUT

    @property
    def report_dir(self) -> Path:
        return self.root / REPORT

    def score_dir(self, name: str) -> Path:
        return self.root / SCORES / name

    def manifest(self) -> dict:
        if not self.root.is_dir():
            raise ProbeError(f"{self.root}: run directory not found")
        manifest = read_json(self.manifest_path)
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise ProbeError(
                f"{self.manifest_path}: schema_version {manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}"
            )
        check_routing_fields(manifest, self.manifest_path)
        return manifest

    def score_sets(self) -> list[str]:
        scores = self.root / SCORES
        if not scores.is_dir():
            return []
        return sorted(p.name for p in scores.iterdir() if (p / MANIFEST).is_file())

    def side_dir(self, side: str) -> Path:
        """`rollout`, `scores/NAME` or a bare score-set NAME."""
        if side == ROLLOUT:
            return self.rollout_dir
        name = side.split("/", 1)[1] if side.startswith(f"{SCORES}/") else side
        return self.score_dir(name)

    def side_manifest(self, side: str) -> dict:
        return self.manifest() if side == ROLLOUT else read_json(self.side_dir(side) / MANIFEST)
