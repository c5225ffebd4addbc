"""Preparing an output folder for generate/rescore: refuse, resume or overwrite."""

from __future__ import annotations

import shutil
from pathlib import Path

from .errors import ProbeError
from .table_io import remove_unfinished


def prepare_output(directory: Path, resume: bool, overwrite: bool, what: str) -> None:
    """Make `directory` ready to write. A non-empty one needs --resume (keep finished parts) or --overwrite."""
    if resume and overwrite:
        raise ProbeError("--resume and --overwrite exclude each other")
    if directory.exists() and not directory.is_dir():
        raise ProbeError(f"{directory}: exists and is not a directory")
    populated = directory.is_dir() and any(directory.iterdir())
    if populated and overwrite:
        shutil.rmtree(directory)
    elif populated and not resume:
        raise ProbeError(f"{directory}: {what} already exists; pass --resume to continue it or --overwrite to replace it")
    elif resume and not populated:
        raise ProbeError(f"{directory}: nothing to resume ({what} not found)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ProbeError(f"{directory}: output directory is not writable ({exc.strerror})") from exc
    remove_unfinished(directory)
