"""JSON files of a run (manifests, metrics.json): atomic writes, and reads that name the file on error."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.location import is_remote, run_path


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader never sees a half-written file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str, what: str = "") -> None:
    """Write a UTF-8 text file whole or not at all: beside it, then renamed over it (a failed write leaves
    no temporary file). An object store (a run at a URL) has no rename, but shows an object only once it
    is written whole. `what` names the file's kind in the error ("JUnit XML")."""
    path = run_path(path)
    tmp = None if is_remote(path) else path.with_name(f".{path.name}.tmp")
    try:
        (tmp or path).write_text(text, encoding="utf-8")
        if tmp is not None:
            os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise ProbeError(f"{path}: cannot write{' ' + what if what else ''} ({exc.strerror or exc})") from exc


def read_document(path: Path, parse: Callable[[str], object], kind: str, errors: tuple[type[Exception], ...]) -> dict:
    """Read and parse a text file that must hold one object (a JSON object, a TOML table)."""
    path = run_path(path)
    if not path.is_file():
        raise ProbeError(f"{path}: file not found")
    try:
        obj = parse(path.read_text())
    except (*errors, UnicodeDecodeError) as exc:
        raise ProbeError(f"{path}: not valid {kind} ({exc})") from exc
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not isinstance(obj, dict):
        raise ProbeError(f"{path}: expected a {kind} object, found {type(obj).__name__}")
    return obj


def read_json(path: Path) -> dict:
    return read_document(path, json.loads, "JSON", (json.JSONDecodeError,))
